"""Run a multi-process job (``torchrun``, ``mpiexec``) for a test, in a process group of
its own with a deadline: at the deadline the whole group is killed and the test fails with
the output so far, so a hang fails the test instead of leaving stray ranks behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

__all__ = ["REPO", "Launch", "run_group"]

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Launch:
    returncode: int
    output: str
    elapsed_s: float


def run_group(
    command: Sequence[str], *, env: Mapping[str, str], timeout_s: float, what: str
) -> Launch:
    """Run ``command`` from the repository root with ``env`` added to this environment
    (stdout and stderr together); ``what`` names the job in the failure of a hang."""
    start = time.monotonic()
    process = subprocess.Popen(
        list(command),
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
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
        pytest.fail(f"{what} hung for {timeout_s}s:\n{output}")
    return Launch(process.returncode, output, time.monotonic() - start)
