"""MPITransport across processes: ``mpiexec -n 2`` and ``-n 4`` on loopback.

Each test launches a script from ``tests/mpi/scripts`` with the venv's ``mpiexec`` in its
own process group, with a deadline; on timeout the whole group is killed, so a hang fails
the test instead of leaving stray ranks behind.
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from process_group import Launch, run_group

pytest.importorskip("mpi4py")

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

SCRIPTS = Path(__file__).parent / "scripts"
ABORT_DEADLINE_S = 10.0


def find_mpiexec() -> str | None:
    beside_python = Path(sys.executable).with_name("mpiexec")
    return str(beside_python) if beside_python.exists() else shutil.which("mpiexec")


MPIEXEC = find_mpiexec()
needs_mpiexec = pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found")


def launch(ranks: int, *argv: str, timeout_s: float) -> Launch:
    """Run ``mpiexec -n ranks python argv...``; kill its process group at the deadline."""
    assert MPIEXEC is not None
    command = [MPIEXEC, "-n", str(ranks), sys.executable, *argv]
    return run_group(command, env={}, timeout_s=timeout_s, what=f"mpiexec -n {ranks} {argv}")


@needs_mpiexec
@pytest.mark.parametrize("ranks", [2, 4])
def test_exchange_is_bit_exact_across_processes(ranks: int) -> None:
    result = launch(ranks, str(SCRIPTS / "exchange.py"), timeout_s=90)
    assert result.returncode == 0, result.output
    for rank in range(ranks):
        cases = 15  # scripts/exchange.py's CASES: arrays each rank sends each peer each way
        assert f"rank {rank} OK: {2 * cases * (ranks - 1)} messages bit-exact" in result.output


@needs_mpiexec
def test_one_failing_rank_ends_every_process() -> None:
    ranks = 4
    result = launch(ranks, str(SCRIPTS / "fail_one_rank.py"), timeout_s=90)
    ended_at = time.time()
    failed = ranks - 1
    assert result.returncode != 0, result.output
    assert f"rank {failed} failed: InjectedFailure" in result.output
    # MPICH's own abort message is not always forwarded before hydra tears the job down
    assert f"rank {failed} calls MPI_Abort" in result.output
    # every other rank was still waiting for a message: only the abort ended them
    for rank in range(failed):
        assert f"rank {rank} failed" not in result.output
    failing = re.search(r"failing at ([0-9.]+)", result.output)
    assert failing is not None, result.output
    assert ended_at - float(failing.group(1)) < ABORT_DEADLINE_S, result.output


@needs_mpiexec
def test_uncaught_exception_under_python_m_mpi4py_aborts_the_job() -> None:
    """The documented safety net for scripts that do not call ``abort`` themselves."""
    result = launch(
        2, "-m", "mpi4py", str(SCRIPTS / "fail_one_rank.py"), "--no-abort", timeout_s=90
    )
    assert result.returncode != 0, result.output
    assert "InjectedFailure: injected failure on rank 1" in result.output
