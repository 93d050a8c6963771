"""Tied parameters over MPI: the torchrun script ``tests/torch_dist/scripts/tied.py``
under ``mpiexec`` with MPITransport: a GPT-2 style model whose head and embedding are
declared copies on the first and the last rank equals the unsplit model in loss and every
gradient, and both holders' tied gradients are the same bits, swap on as off."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_mpi_transport import launch, needs_mpiexec

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "torch_dist" / "scripts" / "tied.py"


@needs_mpiexec
@pytest.mark.timeout(200)
def test_tied_copies_sum_over_mpi() -> None:
    result = launch(2, str(SCRIPT), "mpi", timeout_s=180)
    assert result.returncode == 0, result.output
    assert "rank 0 OK" in result.output and "rank 1 OK" in result.output, result.output
    found = re.findall(r"rank (\d) (\S+)-swap-(on|off) tied ([0-9a-f]+)", result.output)
    assert len(found) == 8, result.output  # 2 schedules x swap off/on x 2 holders
    for schedule in ("1f1b", "interleaved_1f1b"):
        assert len({digest for _, case, _, digest in found if case == schedule}) == 1
