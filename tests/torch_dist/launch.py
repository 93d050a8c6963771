"""Launch a script of ``tests/torch_dist/scripts`` with ``torchrun --standalone``.

The job runs in its own process group with a deadline; at the deadline the whole group is
killed and the test fails with the output so far, so a hang fails the test instead of
leaving stray ranks behind.
"""

from __future__ import annotations

import sys
from pathlib import Path

from process_group import REPO, Launch, run_group

__all__ = ["REPO", "SCRIPTS", "Launch", "launch"]

SCRIPTS = Path(__file__).parent / "scripts"


def launch(ranks: int, script: str, *argv: str, timeout_s: float) -> Launch:
    """``torchrun --standalone --nproc_per_node ranks script argv...``; killed (the whole
    process group) at the deadline."""
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(ranks),
        str(SCRIPTS / script),
        *argv,
    ]
    what = f"torchrun --nproc_per_node {ranks} {script}"
    return run_group(command, env={"OMP_NUM_THREADS": "1"}, timeout_s=timeout_s, what=what)
