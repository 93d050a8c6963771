"""``ppswap serve``: the training service under uvicorn, with structlog JSON logs on stderr
(one line per event, the job's ``run_id`` bound)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import uvicorn

from ppswap.logs import configure_logging
from ppswap.serve.app import create_app

__all__ = ["serve"]


def serve(host: str, port: int, db: Path, checkpoints: Path | None = None) -> int:
    """Serve on ``host:port`` until interrupted (Ctrl-C, SIGTERM: uvicorn shuts down
    gracefully, cancelling the job in flight); jobs kept in the SQLite file ``db``, their
    checkpoints under ``checkpoints`` (default: beside ``db``)."""
    configure_logging(json=True)
    app = create_app(db, checkpoints)
    config = uvicorn.Config(app, host=host, port=port, lifespan="on", access_log=False)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises Ctrl-C once shut down
        uvicorn.Server(config).run()
    return 0
