"""Tied parameters over MPI.

The torchrun script ``tests/torch_dist/scripts/tied.py`` under ``mpiexec`` with
MPITransport: a GPT-2 style torch model whose head and embedding are declared copies on
the first and the last rank equals the unsplit model in loss and every gradient, and both
holders' tied gradients are the same bits, swap on as off, with the dx/dw split and with
overlap_b_f. ``scripts/run_tied.py``: the MindSpore twin (``tests/runtime/tied_cells.py``),
whose digests equal those of the same stages run in one process. And a rank that changes
its declarations alone between runs is refused on every rank, without a hang."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import anyio
import pytest
from test_mpi_transport import SCRIPTS, launch, needs_mpiexec

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import mse_loss

sys.path.insert(0, str(SCRIPTS))  # run_tied, which puts tests/runtime (tied_cells) on the path
import run_tied
import tied_cells

SCRIPT = Path(__file__).resolve().parents[1] / "torch_dist" / "scripts" / "tied.py"
MINDSPORE_SCRIPT = SCRIPTS / "run_tied.py"
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="no torch")


@needs_torch
@needs_mpiexec
@pytest.mark.timeout(200)
def test_tied_copies_sum_over_mpi() -> None:
    result = launch(2, str(SCRIPT), "mpi", timeout_s=180)
    assert result.returncode == 0, result.output
    assert "rank 0 OK" in result.output and "rank 1 OK" in result.output, result.output
    found = re.findall(r"rank (\d) (\S+)-swap-(on|off) tied ([0-9a-f]+)", result.output)
    # 2 holders each: 2 schedules swap off and on, split_dw and overlap_b_f swap on
    assert len(found) == 12, result.output
    cases = {case for _, case, _, _ in found}
    assert cases == {"1f1b", "interleaved_1f1b", "1f1b_split_dw", "interleaved_1f1b_overlap"}
    for name in cases:
        assert len({digest for _, case, _, digest in found if case == name}) == 1


@needs_torch
@needs_mpiexec
@pytest.mark.timeout(200)
def test_one_rank_changing_its_declarations_is_refused_on_every_rank() -> None:
    """Rank 1 alone drops its declaration between runs: both ranks exchange the
    declarations again and refuse the run with the same ValueError, well inside the step
    deadline (30 s; the exchange used to run on the changed rank only, which then hung
    until it), and train again once it is back."""
    script = SCRIPT.with_name("tied_redeclared.py")
    result = launch(2, str(script), "mpi", timeout_s=180)
    assert result.returncode == 0, result.output
    refused = re.findall(r"rank (\d) run2 ValueError ([0-9.]+)", result.output)
    assert sorted(rank for rank, _ in refused) == ["0", "1"], result.output
    assert all(float(seconds) < 10 for _, seconds in refused), result.output
    assert "rank 0 OK" in result.output and "rank 1 OK" in result.output, result.output


async def in_one_process(name: str) -> str:
    """The tied gradient's digest with both ranks' stages of the case in this process."""
    schedule, vpp, options = run_tied.CASES[name]
    stage_num = 2 * vpp
    modules = tied_cells.cells(stage_num, shared=False)
    stages = [
        PipelineStage(m, s, stage_num, tied=tied_cells.declared(s, stage_num))
        for s, m in enumerate(modules)
    ]
    x, y = tied_cells.data()
    await run_schedule(
        stages,
        schedule,
        pp=2,
        micro_batch_num=run_tied.MICRO,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        step_timeout=60.0,
        **options,
    )
    first, last = stages[0], stages[-1]
    digest: str = tied_cells.digest(
        first.grads[tied_cells.tied_index(first.module, first.parameters)]
    )
    assert digest == tied_cells.digest(
        last.grads[tied_cells.tied_index(last.module, last.parameters)]
    )
    return digest


@needs_mpiexec
@pytest.mark.timeout(300)
def test_mindspore_tied_copies_sum_over_mpi() -> None:
    """MindSpore, 2 processes: every case equals the unsplit model (checked by each
    rank), both holders' tied gradients and swap on and off have one digest per case,
    the digest of the same stages run in one process."""
    result = launch(2, str(MINDSPORE_SCRIPT), timeout_s=240)
    assert result.returncode == 0, result.output
    assert "rank 0 OK" in result.output and "rank 1 OK" in result.output, result.output
    found = re.findall(r"rank (\d) (\S+)-swap-(on|off) tied ([0-9a-f]+)", result.output)
    assert len(found) == 16, result.output  # 4 cases x swap off and on x 2 holders
    for name in run_tied.CASES:
        (digest,) = {digest for _, case, _, digest in found if case == name}
        assert anyio.run(in_one_process, name) == digest, name
