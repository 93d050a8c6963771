"""Launch a script of ``tests/torch_dist/scripts`` with ``torchrun --standalone``.

The job runs in its own process group with a deadline; at the deadline the whole group is
killed and the test fails with the output so far, so a hang fails the test instead of
leaving stray ranks behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["REPO", "SCRIPTS", "Launch", "launch"]

SCRIPTS = Path(__file__).parent / "scripts"
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Launch:
    returncode: int
    output: str
    elapsed_s: float


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
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"torchrun --nproc_per_node {ranks} {script} hung for {timeout_s}s:\n{output}")
    return Launch(process.returncode, output, time.monotonic() - start)
