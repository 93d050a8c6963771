"""MoE stages with recomputation, torch, every rank in this process: pp2 x dp2 x ep2,
the dense and MoE blocks wrapped by ``recompute_wrapper`` (and ``swap_wrapper``), under
``recompute=True`` and under a ``memory_budget``: losses and every rank's gradients
bit-identical to the run that keeps everything.

What a recomputed MoE forward does: it runs the block again, its all-to-alls included
(the counts, the dispatch, the combine). Its routing is the first forward's (the same
inputs and weights, the same bits), so are its splits; its EP peers recompute the same
chunks in the same order (the plan is made per pipeline rank and every dp replica runs
its pipeline rank's order), so the n-th exchange of a block's key meets the peers'
n-th. ``tests/moe/scripts/moe_run.py`` checks the same across processes.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.fsdp import DeviceMesh
from ppswap.scheduler.budget import least_budgets
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel

torch = pytest.importorskip("torch")

from moe_support import (  # noqa: E402
    ep_stages,
    local_grads,
    make_data,
    mse_loss,
    recompute_and_swap,
)

MESH = DeviceMesh(pp=2, dp=2, ep=2)
MICRO = 4


async def _run(
    stages: list[PipelineStage], schedule: str, overlap: bool, **options: Any
) -> RunResult:
    x, y = make_data(MESH.dp * MICRO * 2)
    for stage in stages:
        for param in stage.parameters:
            param.grad = None
    return await run_schedule(
        stages,
        schedule,
        micro_batch_num=MICRO,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        overlap_b_f=overlap,
        step_timeout=60.0,
        **options,
    )


def _grads(stages: list[PipelineStage]) -> list[dict[str, np.ndarray]]:
    return [local_grads(stage) for stage in stages]


def _same(a: list[dict[str, np.ndarray]], b: list[dict[str, np.ndarray]]) -> None:
    for left, right in zip(a, b, strict=True):
        assert left.keys() == right.keys()
        for name, grad in left.items():
            np.testing.assert_array_equal(right[name], grad, err_msg=name)


def _peaks(result: RunResult) -> list[int]:
    """Per pipeline rank, the largest peak of its dp replicas."""
    return [
        max(r.peak_saved_bytes for r in result.ranks if r.rank % MESH.pp == p)
        for p in range(MESH.pp)
    ]


@pytest.mark.asyncio
@pytest.mark.parametrize(("schedule", "overlap"), [("gpipe", False), ("1f1b", True)])
async def test_recompute_and_budget_are_bit_identical(schedule: str, overlap: bool) -> None:
    stages = ep_stages(2, MESH, 2, wrap=recompute_and_swap)
    keep = await _run(stages, schedule, overlap)
    kept = _grads(stages)
    recomputed = await _run(stages, schedule, overlap, recompute=True)
    assert recomputed.losses == keep.losses
    _same(kept, _grads(stages))
    policies = {p for r in recomputed.ranks for p in r.chunk_policy.values()}
    assert policies == {"recompute"}
    assert sum(r.compute_jobs.get("recompute", 0) for r in recomputed.ranks) == 4 * MICRO
    assert all(
        r.peak_saved_bytes < k.peak_saved_bytes
        for r, k in zip(recomputed.ranks, keep.ranks, strict=True)
    )
    swapped = await _run(stages, schedule, overlap, swap=True)
    assert swapped.losses == keep.losses
    _same(kept, _grads(stages))
    model = CostModel.from_result(keep, swapped, recomputed)
    config = ScheduleConfig(
        schedule=schedule,
        pp=MESH.pp,
        micro=MICRO,
        overlap_b_f=overlap,
        swap=True,
        fsdp=True,
        saved_until=stages[0].backend.saved_until,
    )
    least = least_budgets(config, model, frozenset(range(MESH.pp)))
    budget = [max(p // 2, q) for p, q in zip(_peaks(keep), least, strict=True)]
    fitted = await _run(
        stages,
        schedule,
        overlap,
        swap=True,
        memory_budget=dict(enumerate(budget)),
        cost_model=model,
    )
    assert fitted.losses == keep.losses
    _same(kept, _grads(stages))
    chosen = {p for r in fitted.ranks for p in r.chunk_policy.values()}
    assert chosen & {"recompute", "recompute+swap"}, chosen
    for stats in fitted.ranks:
        assert stats.peak_saved_bytes <= budget[stats.rank % MESH.pp]
