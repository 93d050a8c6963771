"""run_schedule over MPITransport, one process per rank: the same results as in-process.

Losses and every gradient must equal the in-process run bit for bit, for GPipe,
Interleaved and 1F1B with real overlap, with swap on, at ``mpiexec -n 2`` and ``-n 4``,
for a bfloat16 model at ``-n 2``, for stages passing a tuple of tensors at ``-n 3`` and
for torch stages at ``-n 2``.
A failing rank ends every process non-zero, naming itself, well within the deadline.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from test_mpi_transport import SCRIPTS, launch, needs_mpiexec

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import build_mlp_stages, build_tuple_stages, mse_loss
from ppswap.swap import swap_wrapper

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

sys.path.insert(0, str(SCRIPTS))
from pipeline_data import DIM, bf16_data, bf16_loss, bf16_stages, data, host  # noqa: E402

CASES = [
    # (ranks, schedule, stage_num, micro, overlap)
    (2, "gpipe", 2, 4, False),
    (4, "gpipe", 4, 4, False),
    (2, "interleaved_1f1b", 4, 4, False),
    (2, "1f1b", 2, 4, True),
    (4, "1f1b", 4, 8, True),
]


def _in_process(schedule: str, stage_num: int, micro: int, overlap: bool, pp: int):
    modules = build_mlp_stages(stage_num, dim=8, wrap=swap_wrapper)
    stages = [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]
    x, y = data()

    async def run():
        return await run_schedule(
            stages,
            schedule,
            micro_batch_num=micro,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=True,
            overlap_b_f=overlap,
            pp=pp,
        )

    result = anyio.run(run)
    grads = {
        f"grad_s{s.stage_index}_{k}": g.asnumpy() for s in stages for k, g in enumerate(s.grads)
    }
    return result, grads


@needs_mpiexec
@pytest.mark.parametrize(("ranks", "schedule", "stage_num", "micro", "overlap"), CASES)
def test_mpi_run_equals_in_process_bit_for_bit(
    tmp_path: Path, ranks: int, schedule: str, stage_num: int, micro: int, overlap: bool
) -> None:
    run = launch(
        ranks,
        str(SCRIPTS / "run_pipeline.py"),
        str(tmp_path),
        schedule,
        str(stage_num),
        str(micro),
        "1" if overlap else "0",
        "1",
        timeout_s=180,
    )
    assert run.returncode == 0, run.output[-3000:]
    reference, ref_grads = _in_process(schedule, stage_num, micro, overlap, ranks)
    seen: set[str] = set()
    for rank in range(ranks):
        got = np.load(tmp_path / f"rank{rank}.npz")
        # Every process gets the last stage's losses and every rank's stats back.
        assert got["losses"].tolist() == reference.losses
        assert got["stat_ranks"].tolist() == list(range(ranks))
        assert got["offloaded"].tolist() == [r.offloaded_bytes for r in reference.ranks]
        for name in got.files:
            if name.startswith("grad_"):
                np.testing.assert_array_equal(got[name], ref_grads[name])
                seen.add(name)
    assert seen == set(ref_grads)


def _launch_and_compare(
    tmp_path: Path,
    args: list[str],
    stages: list[PipelineStage],
    run: Any,
    as_bits: bool = False,
    ranks: int | None = None,
) -> None:
    """``run_pipeline.py`` over ``ranks`` processes (default ``len(stages)``: one stage
    each; rank r runs stages r, r + ranks, ...) against ``run`` (the same pipeline in this
    process, on ``stages``): losses, stats and every stage's gradients bit for bit
    (``as_bits``: compared as uint16, bfloat16's bits)."""
    ranks = len(stages) if ranks is None else ranks
    launched = launch(ranks, str(SCRIPTS / "run_pipeline.py"), str(tmp_path), *args, timeout_s=180)
    assert launched.returncode == 0, launched.output[-3000:]
    reference = anyio.run(run)
    assert sum(r.offloaded_bytes for r in reference.ranks) > 0
    for rank in range(ranks):
        got = np.load(tmp_path / f"rank{rank}.npz")
        assert got["losses"].tolist() == reference.losses
        assert got["offloaded"].tolist() == [r.offloaded_bytes for r in reference.ranks]
        for stage in stages[rank::ranks]:
            for k, grad in enumerate(stage.grads):
                want = host(grad).view(np.uint16) if as_bits else host(grad)
                np.testing.assert_array_equal(got[f"grad_s{stage.stage_index}_{k}"], want)


@needs_mpiexec
def test_a_bfloat16_run_across_processes_equals_in_process_bit_for_bit(tmp_path: Path) -> None:
    """A bfloat16 MindSpore model (elementwise: MindSpore's CPU kernels reduce no bfloat16)
    over two processes, GPipe with swap: its activations and gradients cross as
    ml_dtypes' bfloat16 (MindSpore's own numpy type has no name on the wire)."""
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(bf16_stages(2, rows=2))]
    x, y = bf16_data()

    async def in_process():
        return await run_schedule(
            stages, "gpipe", micro_batch_num=4, inputs=x, targets=y, loss_fn=bf16_loss, swap=True
        )

    args = ["gpipe", "2", "4", "0", "1", "0", "bfloat16"]
    _launch_and_compare(tmp_path, args, stages, in_process, as_bits=True)


@needs_mpiexec
def test_a_tuple_between_stages_across_processes_equals_in_process_bit_for_bit(
    tmp_path: Path,
) -> None:
    """Three tensors between stages (``TupleStage``: an int32 mask among them), 1F1B over
    three processes with swap: each tuple crosses packed into one message, and the
    gradients come back without one for the mask."""
    modules = build_tuple_stages(3, dim=DIM, wrap=swap_wrapper)
    stages = [PipelineStage(m, i, 3) for i, m in enumerate(modules)]
    x, y = data()

    async def in_process():
        return await run_schedule(
            stages, "1f1b", micro_batch_num=8, inputs=x, targets=y, loss_fn=mse_loss, swap=True
        )

    _launch_and_compare(tmp_path, ["1f1b", "3", "8", "0", "1", "0", "tuple"], stages, in_process)


@needs_mpiexec
def test_a_torch_pipeline_over_mpi_equals_in_process_bit_for_bit(tmp_path: Path) -> None:
    """torch stages (attention and MLP blocks) over MPITransport, Interleaved with swap on
    two processes: payloads are host arrays either way, so the torch backend rides the
    MPI transport as MindSpore's does."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_backend"))
    import torch
    import torch_support

    torch.set_num_threads(1)  # as in the ranks: the same kernels, the same bits
    modules = torch_support.build_modules(4)
    stages = [PipelineStage(m, i, 4) for i, m in enumerate(modules)]
    x, y = torch_support.make_data()

    async def in_process():
        return await run_schedule(
            stages,
            "interleaved_1f1b",
            pp=2,
            micro_batch_num=4,
            inputs=x,
            targets=y,
            loss_fn=torch_support.mse_loss,
            swap=True,
        )

    args = ["interleaved_1f1b", "4", "4", "0", "1", "0", "torch"]
    _launch_and_compare(tmp_path, args, stages, in_process, ranks=2)


@needs_mpiexec
def test_a_failing_rank_ends_every_process_naming_itself(tmp_path: Path) -> None:
    run = launch(
        4,
        str(SCRIPTS / "run_pipeline.py"),
        str(tmp_path),
        "1f1b",
        "4",
        "8",
        "0",
        "1",
        "1",
        timeout_s=120,
    )
    assert run.returncode != 0
    assert "rank 1 failed" in run.output
    assert "rank 1, actor compute, step F1.1" in run.output
    assert run.elapsed_s < 60  # far inside the 60 s step deadline every peer waits under
    assert not list(tmp_path.glob("rank*.npz"))  # nobody finished
