"""The order of FSDP's and swap's steps: on the finalized orders, and in a real run's trace.

``FWD -> (its sends) -> SWAP_LAUNCH_OFFLOAD -> FSDP_RESHARD`` and
``SWAP_LAUNCH_LOAD -> FSDP_UNSHARD -> SWAP_WAIT_LOAD -> BWD``; when the consumer's stage
is already unsharded (no UNSHARD opens its use run) the load is delayed into the
consumer's own gap.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from fsdp_support import batch, read_spans, sharded_stages

from ppswap import run_schedule
from ppswap.demo.model import mse_loss
from ppswap.fsdp import DeviceMesh
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders, unshard_index_for
from ppswap.scheduler.steps import COMPOSITE_KINDS, MetaStep, Order, StepKind


def _leaf_index(order: Order) -> dict[tuple[StepKind, int, int], int]:
    index: dict[tuple[StepKind, int, int], int] = {}
    for position, step in enumerate(order):
        for leaf in step.sub_steps if step.kind in COMPOSITE_KINDS else (step,):
            index[(leaf.kind, leaf.stage, leaf.micro)] = position
    return index


def _is_send(step: MetaStep) -> bool:
    sends = (StepKind.SEND_F, StepKind.SEND_B)
    return step.kind in sends or (
        step.kind is StepKind.BATCH_SEND_RECV and any(s.kind in sends for s in step.sub_steps)
    )


def check_rfc_orders(order: Order) -> tuple[int, int, int]:
    """Assert the FSDP and swap steps' order on one finalized order. Returns how many chunks had
    ``FWD -> LO -> RESHARD``, ``LL -> UNSHARD -> WL -> consumer`` and a delayed load."""
    at = _leaf_index(order)
    offload_reshard = load_unshard = delayed = 0
    for position, step in enumerate(order):
        stage, micro = step.stage, step.micro
        if step.kind is StepKind.SWAP_LAUNCH_OFFLOAD:
            # right after its FWD's slot and that slot's sends
            between = order[at[(StepKind.FWD, stage, micro)] + 1 : position]
            assert all(_is_send(s) for s in between), [s.short() for s in between]
            gap = itertools.takewhile(lambda s: not s.is_compute, order[position + 1 :])
            if MetaStep(StepKind.FSDP_RESHARD, stage, -1) in list(gap):
                offload_reshard += 1
        if step.kind is StepKind.SWAP_WAIT_LOAD:
            consumer = position + 1
            assert order[consumer].is_compute
            launch = at[(StepKind.SWAP_LAUNCH_LOAD, stage, micro)]
            unshard = unshard_index_for(order, consumer, stage)
            if unshard is None:
                assert not any(s.is_compute for s in order[launch:consumer])
                delayed += 1
            else:
                assert order[unshard] == MetaStep(StepKind.FSDP_UNSHARD, stage, -1)
                assert launch < unshard < position < consumer
                load_unshard += 1
    return offload_reshard, load_unshard, delayed


CONFIGS = [
    ScheduleConfig(schedule="gpipe", pp=2, micro=4, fsdp=True, swap=True),
    ScheduleConfig(schedule="gpipe", pp=4, micro=8, fsdp=True, swap=True, p2p="batch"),
    ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=4, fsdp=True, swap=True),
    ScheduleConfig(schedule="interleaved_1f1b", pp=4, vpp=2, micro=8, fsdp=True, swap=True),
    ScheduleConfig(schedule="1f1b", pp=4, micro=8, fsdp=True, swap=True, overlap_b_f=True),
    ScheduleConfig(
        schedule="1f1b", pp=4, micro=8, fsdp=True, swap=True, overlap_b_f=True, split_dw=True
    ),
]


@pytest.mark.parametrize(
    "config", CONFIGS, ids=lambda c: f"{c.schedule}-pp{c.pp}-{c.p2p}-dw{c.split_dw:d}"
)
def test_rfc_fsdp_orders_on_every_rank(config: ScheduleConfig) -> None:
    totals = [0, 0, 0]
    for order in build_all_orders(config):
        for i, count in enumerate(check_rfc_orders(order)):
            totals[i] += count
    assert sum(totals) > 0
    if config.schedule != "1f1b":
        assert totals[0] > 0  # FWD -> LO -> RESHARD seen
    if config.schedule == "gpipe":
        assert totals[1] > 0  # LL -> UN -> WL -> B seen


def _top_level(spans: list, rank: int, lane: str) -> list:  # type: ignore[type-arg]
    """Spans of a lane that are not nested in another span of the same lane."""
    lane_spans = [s for s in spans if s.rank == rank and s.lane == lane]
    return [
        s
        for s in lane_spans
        if not any(o is not s and o.start <= s.start and s.end <= o.end for o in lane_spans)
    ]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("schedule", "pp", "stage_num", "micro"),
    [("gpipe", 2, 2, 4), ("interleaved_1f1b", 2, 4, 4)],
)
async def test_the_runtime_executes_the_orders_and_gathers_on_the_p2p_lane(
    tmp_path: Path, schedule: str, pp: int, stage_num: int, micro: int
) -> None:
    mesh = DeviceMesh(pp=pp, dp=2)
    config = ScheduleConfig(
        schedule=schedule,
        pp=pp,
        vpp=stage_num // pp,
        micro=micro,
        fsdp=True,
        swap=True,  # type: ignore[arg-type]
    )
    orders = build_all_orders(config)
    x, y = batch(2 * micro)
    result = await run_schedule(
        sharded_stages(stage_num, mesh),
        schedule,
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=True,
        pp=pp,
        trace=tmp_path / "trace.json",
    )
    assert result.trace_path is not None
    spans = read_spans(result.trace_path)
    for rank in range(mesh.world_size):
        order = orders[rank % pp]
        check_rfc_orders(order)
        names = {step.short() for step in order}
        compute = [s for s in _top_level(spans, rank, "compute") if s.name in names]
        # The compute actor ran the finalized order, step after step, in that order.
        assert [s.name for s in compute] == [step.short() for step in order]
        # (two sends and receives posted in one gap of a batch are drawn in it side by
        # side: their microsecond timestamps may meet with a rounding of 1 ns)
        assert all(a.end <= b.start + 0.002 for a, b in itertools.pairwise(compute))
        # One all-gather on the P2P lane per FSDP_UNSHARD, issued by it and done before
        # the first compute that needs it ends.
        gathers = [s for s in spans if s.rank == rank and s.lane == "p2p"]
        unshards = [(i, s) for i, s in enumerate(compute) if s.name.startswith("UN.")]
        for i, unshard in unshards:
            stage = order[i].stage
            gather = next(
                g
                for g in gathers
                if g.name == f"all_gather unshard.s{stage}" and g.start >= unshard.start
            )
            first_use = next(
                c
                for j, c in enumerate(compute)
                if j > i and order[j].is_compute and order[j].stage == stage
            )
            assert gather.end <= first_use.end
        all_gathers = [g for g in gathers if g.name.startswith("all_gather unshard.s")]
        assert len(all_gathers) == len(unshards)
        reduce_names = sorted(g.name for g in gathers if g.name.startswith("reduce_scatter"))
        expected = sorted(f"reduce_scatter_sum grads.s{s}.<f4" for s in config.stages_of(rank % pp))
        assert reduce_names == expected
