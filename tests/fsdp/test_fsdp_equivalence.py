"""FSDP (dp=2) x PP: equal to the unsplit model on the whole batch, swap on/off bit-identical.

Every parameter is sharded with padding (DIM = 7: odd first dimensions). Gradients are
gathered from the replicas' shard gradients with ``full_gradients``.
"""

from __future__ import annotations

import numpy as np
import pytest
from fsdp_support import DIM, batch, sharded_stages

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss, unsplit_loss_and_grads
from ppswap.fsdp import DeviceMesh, fsdp_state_of, full_gradients, full_parameters

DP = 2

CASES = [
    # (schedule, pp, stage_num, micro, overlap_b_f, split_dw)
    ("gpipe", 2, 2, 4, False, False),
    ("gpipe", 4, 4, 4, False, False),
    ("interleaved_1f1b", 2, 4, 4, False, False),
    ("interleaved_1f1b", 4, 8, 4, False, False),
    ("1f1b", 2, 2, 4, True, False),
    ("1f1b", 4, 4, 8, True, True),
]


async def _run(
    schedule: str, pp: int, stage_num: int, micro: int, overlap: bool, split_dw: bool, swap: bool
) -> tuple[list[PipelineStage], RunResult, list[list[np.ndarray]]]:
    mesh = DeviceMesh(pp=pp, dp=DP)
    stages = sharded_stages(stage_num, mesh)
    x, y = batch(DP * micro)
    result = await run_schedule(
        stages,
        schedule,
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=swap,
        pp=pp,
        overlap_b_f=overlap,
        split_dw=split_dw,
        step_timeout=60,
    )
    grads = [
        full_gradients([s for s in stages if s.stage_index == index]) for index in range(stage_num)
    ]
    return stages, result, grads


@pytest.mark.asyncio
@pytest.mark.parametrize(("schedule", "pp", "stage_num", "micro", "overlap", "split_dw"), CASES)
async def test_fsdp_matches_unsplit_and_swap_is_bit_identical(
    schedule: str, pp: int, stage_num: int, micro: int, overlap: bool, split_dw: bool
) -> None:
    stages, base, base_grads = await _run(
        schedule, pp, stage_num, micro, overlap, split_dw, swap=False
    )
    _, swapped, swap_grads = await _run(
        schedule, pp, stage_num, micro, overlap, split_dw, swap=True
    )
    assert len(base.ranks) == pp * DP
    assert [r.rank for r in base.ranks] == list(range(pp * DP))
    assert len(base.losses) == micro
    assert swapped.losses == base.losses  # bit-identical floats
    for stage_base, stage_swap in zip(base_grads, swap_grads, strict=True):
        for g0, g1 in zip(stage_base, stage_swap, strict=True):
            np.testing.assert_array_equal(g0, g1)
    if schedule == "gpipe":
        assert all(r.offloaded_bytes > 0 for r in swapped.ranks)

    # The parameters are back to their shards and unchanged (no optimizer step).
    reference_modules = build_mlp_stages(stage_num, dim=DIM)
    for index, module in enumerate(reference_modules):
        replicas = [s.module for s in stages if s.stage_index == index]
        assert all(not fsdp_state_of(m).unsharded for m in replicas)  # type: ignore[union-attr]
        for full, ref in zip(full_parameters(replicas), module.trainable_params(), strict=True):
            np.testing.assert_array_equal(full, ref.asnumpy())

    x, y = batch(DP * micro)
    ref_loss, ref_grads = unsplit_loss_and_grads(reference_modules, x, y, mse_loss)
    np.testing.assert_allclose(base.loss, ref_loss, rtol=1e-5)
    for stage_ref, stage_run in zip(ref_grads, base_grads, strict=True):
        for g_ref, g_run in zip(stage_ref, stage_run, strict=True):
            assert g_run.shape == g_ref.shape
            np.testing.assert_allclose(g_run, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.asyncio
async def test_losses_are_the_mean_over_replicas_of_each_micro_batch() -> None:
    """losses[m] is the mean of the replicas' micro-batch m: compare with two pp-only
    runs, one per dp block of the batch."""
    micro = 2
    mesh = DeviceMesh(pp=2, dp=DP)
    x, y = batch(DP * micro * 2)
    sharded = sharded_stages(2, mesh)
    fsdp = await run_schedule(
        sharded,
        "gpipe",
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
    )
    half = x.shape[0] // DP
    per_block = []
    for d in range(DP):
        stages = [PipelineStage(m, i, 2) for i, m in enumerate(build_mlp_stages(2, dim=DIM))]
        block = slice(d * half, (d + 1) * half)
        result = await run_schedule(
            stages,
            "gpipe",
            micro_batch_num=micro,
            inputs=x[block],
            targets=y[block],
            loss_fn=mse_loss,
        )
        per_block.append(result.losses)
    expected = [(a + b) / 2 for a, b in zip(*per_block, strict=True)]
    np.testing.assert_allclose(fsdp.losses, expected, rtol=1e-6)
    # Each replica's stage.grads holds shard gradients: the shapes of its shard parameters.
    for stage in sharded:
        shapes = [tuple(p.shape) for p in stage.parameters]
        assert [tuple(g.shape) for g in stage.grads] == shapes
        assert shapes[0] == (DIM, DIM)  # fc1.weight (2*DIM, DIM) split in two
