"""The ``ppswap serve`` subcommand's parser. The service's modules (Starlette, uvicorn,
prometheus-client: the ``serve`` extra) are loaded only to run it, so ``ppswap`` works
without the extra and says how to install it when it is missing."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

from ppswap.cli_args import fail, install_hint

__all__ = ["DEFAULT_DB", "SERVE_MODULES", "add_serve_parser"]

DEFAULT_DB = Path("ppswap-serve.sqlite3")
SERVE_MODULES = frozenset({"starlette", "uvicorn", "prometheus_client"})
"""The packages of the ``serve`` extra the service imports."""


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int from 0 to 65535, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an int from 0 to 65535, got {port}")
    return port


def run_serve(args: argparse.Namespace) -> int:
    try:
        main = importlib.import_module("ppswap.serve.main")
    except ModuleNotFoundError as missing:
        if missing.name not in SERVE_MODULES:
            raise
        return fail(f"ppswap serve needs {missing.name}: {install_hint('serve')}")
    status: int = main.serve(args.host, args.port, args.db, args.checkpoints)
    return status


def add_serve_parser(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve training jobs over HTTP (the serve extra)",
        description=(
            "A training service: POST /runs trains the demo LM with the run options given "
            "as JSON; GET /runs/{id}, DELETE /runs/{id}, POST /runs/{id}/resume (an "
            "interrupted run, from its last checkpoint), GET /runs/{id}/events (server-sent "
            "events), GET /metrics (Prometheus), GET /healthz, GET / (the live page)."
        ),
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=_port, default=8000, help="port (default 8000)")
    serve.add_argument(
        "--db", type=Path, default=DEFAULT_DB, help=f"the jobs' SQLite file (default {DEFAULT_DB})"
    )
    serve.add_argument(
        "--checkpoints",
        type=Path,
        default=None,
        help="the folder of the jobs' checkpoints (default: beside --db, <db>.checkpoints)",
    )
    serve.set_defaults(handler=run_serve)
