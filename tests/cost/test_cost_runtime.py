"""``swap_policy="cost"`` and ``"peak"`` through ``run_schedule`` and the Schedule classes:
the run moves exactly the chunks the planner chose, and the numbers stay bit-identical to
the fixed rule."""

from __future__ import annotations

import numpy as np
import pytest

from ppswap import PipelineStage, ScheduleGPipe, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import CostModel, plan_cost_aware
from ppswap.swap import swap_wrapper

DIM = 8
MICRO = 4
# Planner inputs only (the run's copy engine is not throttled): copies of one compute leaf
# on one copy stream per rank on GPipe pp2 m4 leave room for two of the four chunks of
# each rank.
TIGHT = CostModel(
    chunk_bytes=1000, d2h_gbps=1e-6, h2d_gbps=1e-6, leaf_s=1.0, split_directions=False
)


def _stages() -> list[PipelineStage]:
    modules = build_mlp_stages(2, dim=DIM, wrap=swap_wrapper)
    return [PipelineStage(m, i, 2) for i, m in enumerate(modules)]


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((MICRO * 2, DIM)).astype(np.float32)
    return x, rng.standard_normal((MICRO * 2, DIM)).astype(np.float32)


@pytest.mark.asyncio
async def test_the_run_moves_the_chosen_chunks_and_matches_the_fixed_rule() -> None:
    plan = plan_cost_aware(ScheduleConfig(schedule="gpipe", pp=2, micro=MICRO), TIGHT)
    chosen = [len(rank.chunks) for rank in plan.ranks]
    assert chosen == [2, 2]
    x, y = _data()
    stages = _stages()
    common = {"micro_batch_num": MICRO, "inputs": x, "targets": y, "loss_fn": mse_loss}
    fixed = await run_schedule(stages, "gpipe", swap=True, **common)
    fixed_grads = [[g.asnumpy() for g in s.grads] for s in stages]
    cost = await run_schedule(
        stages, "gpipe", swap=True, swap_policy="cost", cost_model=TIGHT, **common
    )
    cost_grads = [[g.asnumpy() for g in s.grads] for s in stages]
    assert [r.copies for r in fixed.ranks] == [2 * MICRO, 2 * MICRO]
    assert [r.copies for r in cost.ranks] == [2 * n for n in chosen]
    assert 0 < cost.ranks[0].offloaded_bytes < fixed.ranks[0].offloaded_bytes
    assert cost.losses == fixed.losses
    for fixed_stage, cost_stage in zip(fixed_grads, cost_grads, strict=True):
        for g0, g1 in zip(fixed_stage, cost_stage, strict=True):
            np.testing.assert_array_equal(g0, g1)


@pytest.mark.asyncio
async def test_the_peak_policy_matches_the_fixed_rule_with_fewer_copies() -> None:
    """GPipe pp2 m4: the fixed rule moves all 4 chunks of each rank, the peak policy 2; the
    losses and gradients are bit-identical and the measured peak of saved bytes is the
    same on every rank."""
    x, y = _data()
    stages = _stages()
    common = {"micro_batch_num": MICRO, "inputs": x, "targets": y, "loss_fn": mse_loss}
    fixed = await run_schedule(stages, "gpipe", swap=True, **common)
    fixed_grads = [[g.asnumpy() for g in s.grads] for s in stages]
    peak = await run_schedule(stages, "gpipe", swap=True, swap_policy="peak", **common)
    peak_grads = [[g.asnumpy() for g in s.grads] for s in stages]
    assert [r.copies for r in fixed.ranks] == [2 * MICRO, 2 * MICRO]
    assert [r.copies for r in peak.ranks] == [4, 4]
    assert [r.peak_saved_bytes for r in peak.ranks] == [r.peak_saved_bytes for r in fixed.ranks]
    for peak_rank, fixed_rank in zip(peak.ranks, fixed.ranks, strict=True):
        assert 0 < peak_rank.offloaded_bytes < fixed_rank.offloaded_bytes
    assert peak.losses == fixed.losses
    for fixed_stage, peak_stage in zip(fixed_grads, peak_grads, strict=True):
        for g0, g1 in zip(fixed_stage, peak_stage, strict=True):
            np.testing.assert_array_equal(g0, g1)


@pytest.mark.asyncio
async def test_the_schedule_class_carries_the_policy() -> None:
    x, y = _data()
    schedule = ScheduleGPipe(
        _stages(), MICRO, loss_fn=mse_loss, swap=True, swap_policy="cost", cost_model=TIGHT
    )
    result = await schedule.run_async(x, targets=y)
    assert [r.copies for r in result.ranks] == [4, 4]


@pytest.mark.asyncio
async def test_bad_policies_are_refused_before_anything_runs() -> None:
    x, y = _data()
    stages = _stages()
    with pytest.raises(TypeError, match="swap_policy='cost' needs cost_model"):
        await run_schedule(
            stages,
            "gpipe",
            micro_batch_num=MICRO,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=True,
            swap_policy="cost",
        )
    with pytest.raises(ValueError, match="swap_policy must be one of gap, cost, peak, got 'fast'"):
        ScheduleGPipe(stages, MICRO, loss_fn=mse_loss, swap=True, swap_policy="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cost_model is only used with swap_policy='cost'"):
        ScheduleGPipe(stages, MICRO, loss_fn=mse_loss, swap=True, cost_model=TIGHT)
    assert all(stage.generation == 0 for stage in stages)
