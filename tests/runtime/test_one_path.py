"""Every run takes the one batched path: a fault plan wraps it, FSDP joins it.

Counted in compute-thread hops (``RankStats.compute_batches``: the jobs the compute actor
hands the thread). In-process ranks share the thread and park their batches, so a rank's
whole order is one batch when nothing ends it early.

- An empty ``FaultPlan`` changes nothing: the same hops per rank as no plan at all.
- A ``call_at`` rule ends a batch before its step (its callback runs on the event loop):
  at most one hop more per matching step.
- An FSDP rank runs its FSDP_UNSHARD / FSDP_RESHARD steps and the install of each
  all-gather inside its batches; after the order, one job installs the reduce-scattered
  gradients. Bound: a batch may end (yield) only at a collective the thread waits for, so
  hops <= all-gathers + 1 (the walk) + 1 (the gradient install); the one-step path this
  replaced took a hop per step (33-40 per rank for this case).
"""

from __future__ import annotations

import numpy as np
import pytest

from ppswap import PipelineStage, RunOptions, StepKind, run_schedule
from ppswap.core.faults import FaultPlan, call_at
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.planning.prepare import prepare_run
from ppswap.results import RunResult
from ppswap.swap import swap_wrapper

STAGES, MICRO = 4, 8


def _stages(mesh: DeviceMesh | None = None) -> list[PipelineStage]:
    stages = []
    for dp_rank in range(1 if mesh is None else mesh.dp):
        for index, module in enumerate(build_mlp_stages(STAGES, dim=8, wrap=swap_wrapper)):
            if mesh is not None:
                fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            stages.append(PipelineStage(module, index, STAGES))
    return stages


async def _run(stages: list[PipelineStage], **options: object) -> RunResult:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4 * MICRO, 8)).astype(np.float32)
    y = rng.standard_normal((4 * MICRO, 8)).astype(np.float32)
    return await run_schedule(
        stages,
        "gpipe",
        micro_batch_num=MICRO,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=True,
        **options,
    )


def _hops(result: RunResult) -> list[int]:
    return [rank.compute_batches for rank in result.ranks]


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_an_empty_fault_plan_takes_the_same_hops_as_none() -> None:
    plain = await _run(_stages())
    empty = await _run(_stages(), faults=FaultPlan())
    assert _hops(empty) == _hops(plain)
    assert empty.losses == plain.losses
    assert sum(_hops(plain)) <= 2 * len(plain.ranks)  # about one batch per rank


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_callback_rule_ends_one_batch_at_its_step() -> None:
    plain = await _run(_stages())
    seen: list[str] = []
    plan = FaultPlan((call_at(lambda: seen.append("B0.1"), StepKind.BWD, rank=1, micro=0),))
    called = await _run(_stages(), faults=plan)
    assert seen == ["B0.1"]
    for rank, (with_rule, without) in enumerate(zip(_hops(called), _hops(plain), strict=True)):
        assert with_rule <= without + (1 if rank == 1 else 0), rank
    assert called.losses == plain.losses


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_an_fsdp_rank_takes_about_one_hop_per_collective_not_one_per_step() -> None:
    mesh = DeviceMesh(dp=2, pp=4)
    result = await _run(_stages(mesh))  # its numbers: tests/fsdp/test_fsdp_equivalence.py
    for rank in result.ranks:
        assert rank.steps_executed > 30  # the bound below is far below a hop per step
        unshards = _unshards(mesh, rank.rank)
        assert rank.compute_batches <= unshards + 2, (rank.rank, rank.compute_batches)


def _unshards(mesh: DeviceMesh, rank: int) -> int:
    """The FSDP_UNSHARD steps of world rank ``rank``'s order in this case."""
    stages = _stages(mesh)
    plan = prepare_run(
        stages,
        RunOptions(schedule="gpipe", micro_batch_num=MICRO, swap=True),
        inputs=np.zeros((4 * MICRO, 8), np.float32),
        targets=np.zeros((4 * MICRO, 8), np.float32),
        loss_fn=mse_loss,
        trace=None,
    )
    return sum(step.kind is StepKind.FSDP_UNSHARD for step in plan.orders[rank])
