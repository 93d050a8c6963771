"""Property tests of the swap pass on real lowered orders: every family, flag, P2P mode, FSDP.

For every rank: each eligible chunk gets exactly the four swap steps in life-cycle order
before its consumer and after its FWD; ineligible chunks get none; swap steps never enter
a container; removing them gives back the swap-free order exactly; the memory with swap
never exceeds the memory without; and the cross-rank timeline still completes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders, unshard_index_for
from ppswap.scheduler.peak import peak_chunks
from ppswap.scheduler.planning import planned_orders
from ppswap.scheduler.simulate import build_timeline, memory_profile
from ppswap.scheduler.steps import (
    CONSUMER_KINDS,
    SWAP_KIND_ORDER,
    MetaStep,
    Order,
    StepKind,
    iter_leaves,
)
from ppswap.scheduler.swap_plan import (
    compute_slots,
    eligible_chunks,
    inject_swap_steps,
    plan_swap,
    strip_swap_steps,
)
from ppswap.scheduler.validate import validate_all


@st.composite
def swap_configs(draw: st.DrawFn) -> ScheduleConfig:
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]))
    pp = draw(st.integers(1, 5))
    vpp = draw(st.integers(2, 3)) if schedule == "interleaved_1f1b" else 1
    if schedule == "interleaved_1f1b":
        micro = pp * draw(st.integers(1, 4))
    else:
        micro = draw(st.integers(1, 12))
    return ScheduleConfig(
        schedule=schedule,
        pp=pp,
        vpp=vpp,
        micro=micro,
        split_dw=draw(st.booleans()),
        overlap_b_f=schedule != "gpipe" and draw(st.booleans()),
        p2p=draw(st.sampled_from(["plain", "batch", "boundary"])),
        fsdp=draw(st.booleans()),
        swap=True,
        min_swap_gap=draw(st.integers(2, 6)),
    )


def _top_index_of_leaf(order: Order, kinds: frozenset[StepKind]) -> dict[tuple[int, int], int]:
    found: dict[tuple[int, int], int] = {}
    for index, step in enumerate(order):
        for leaf in iter_leaves((step,)):
            if leaf.kind in kinds and step.is_compute:
                found[leaf.chunk] = index
    return found


def check_fsdp_anchor(
    order: Order, base: Order, swap_at: dict[tuple[int, int], list[tuple[StepKind, int]]]
) -> None:
    """LAUNCH_LOAD agrees with lowering's own notion of the consumer's unshard."""
    new_index = [i for i, step in enumerate(order) if not step.is_swap]
    for (stage, _micro), found in swap_at.items():
        wait_offload, launch_load, wait_load = (index for _, index in found[1:])
        consumer = wait_load + 1
        base_consumer = new_index.index(consumer)
        unshard = unshard_index_for(base, base_consumer, stage)
        if unshard is None:  # already unsharded: delayed to right before WAIT_LOAD
            between = order[launch_load + 1 : wait_load]
        elif new_index[unshard] > wait_offload:  # LAUNCH_LOAD -> FSDP_UNSHARD
            assert order[new_index[unshard]] == MetaStep(StepKind.FSDP_UNSHARD, stage, -1)
            between = order[launch_load + 1 : new_index[unshard]]
        else:  # the unshard came before this chunk's WAIT_OFFLOAD: right after it
            between = order[wait_offload + 1 : launch_load]
        assert all(step.is_swap for step in between), [s.short() for s in between]


def check_swap_invariants(config: ScheduleConfig) -> None:
    swapped = build_all_orders(config)
    plain = build_all_orders(replace(config, swap=False))
    for rank, (order, base) in enumerate(zip(swapped, plain, strict=True)):
        assert strip_swap_steps(order) == base
        assert inject_swap_steps(base, config, rank) == order
        plans = plan_swap(base, config)
        eligible = {p.chunk for p in plans if p.eligible}
        assert eligible_chunks(order) == eligible
        assert all(p.eligible == (p.gap >= config.min_swap_gap) for p in plans)
        fwd_at = _top_index_of_leaf(order, frozenset({StepKind.FWD}))
        consumer_at = _top_index_of_leaf(order, CONSUMER_KINDS)
        swap_at: dict[tuple[int, int], list[tuple[StepKind, int]]] = {}
        for index, step in enumerate(order):
            if step.is_swap:
                swap_at.setdefault(step.chunk, []).append((step.kind, index))
            elif step.sub_steps:
                assert not any(leaf.is_swap for leaf in iter_leaves(step.sub_steps))
        assert set(swap_at) == eligible
        for chunk, found in swap_at.items():
            assert [kind for kind, _ in found] == list(SWAP_KIND_ORDER), chunk
            positions = [index for _, index in found]
            assert fwd_at[chunk] < positions[0]
            assert positions == sorted(positions)
            assert positions[-1] < consumer_at[chunk]
            assert positions[-1] == consumer_at[chunk] - 1  # WAIT_LOAD right before
        # the slot numbers the plan uses are those of the finalized order
        slots = compute_slots(order)
        for plan in plans:
            assert slots[plan.fwd_slot].index == fwd_at[plan.chunk]
            assert slots[plan.consumer_slot].index == consumer_at[plan.chunk]
        if config.fsdp:
            check_fsdp_anchor(order, base, swap_at)
        with_swap = memory_profile(order)
        without = memory_profile(order, with_swap=False)
        assert all(a <= b for a, b in zip(with_swap, without, strict=True))
        assert min(with_swap, default=0) >= 0
        assert max(without, default=0) == max(memory_profile(base), default=0)
    validate_all(config, swapped)
    timeline = build_timeline(config, swapped)
    unswapped = build_timeline(config, plain)
    assert timeline.num_columns == unswapped.num_columns
    assert timeline.bubbles == unswapped.bubbles
    assert [[(c.column, c.step) for c in cells] for cells in timeline.cells] == [
        [(c.column, c.step) for c in cells] for cells in unswapped.cells
    ]
    for cells in timeline.cells:
        columns = [cell.column for cell in cells]
        assert columns == sorted(set(columns))


@settings(max_examples=80, deadline=None)
@given(swap_configs())
def test_swap_pass_invariants(config: ScheduleConfig) -> None:
    check_swap_invariants(config)


GRID = [
    (schedule, split_dw, overlap, p2p, fsdp, min_gap)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    for split_dw in (False, True)
    for overlap in ((False,) if schedule == "gpipe" else (False, True))
    for p2p in ("plain", "batch", "boundary")
    for fsdp in (False, True)
    for min_gap in (2, 4)
]


@pytest.mark.parametrize(("schedule", "split_dw", "overlap", "p2p", "fsdp", "min_gap"), GRID)
def test_swap_pass_invariants_pp4_m8_grid(
    schedule: str, split_dw: bool, overlap: bool, p2p: str, fsdp: bool, min_gap: int
) -> None:
    check_swap_invariants(
        ScheduleConfig(
            schedule=schedule,  # type: ignore[arg-type]
            pp=4,
            vpp=2 if schedule == "interleaved_1f1b" else 1,
            micro=8,
            split_dw=split_dw,
            overlap_b_f=overlap,
            p2p=p2p,  # type: ignore[arg-type]
            fsdp=fsdp,
            swap=True,
            min_swap_gap=min_gap,
        )
    )


@settings(max_examples=40, deadline=None)
@given(swap_configs())
def test_bwd_weight_never_loads_or_releases(config: ScheduleConfig) -> None:
    for order in build_all_orders(replace(config, split_dw=True, swap=True)):
        for index, step in enumerate(order):
            if step.kind is not StepKind.SWAP_WAIT_LOAD:
                continue
            own = [leaf for leaf in iter_leaves((order[index + 1],)) if leaf.chunk == step.chunk]
            assert [leaf.kind for leaf in own] in ([StepKind.BWD], [StepKind.BWD_INPUT])
        for index, step in enumerate(order):
            if step.kind is StepKind.BWD_WEIGHT and index > 0:
                assert not (order[index - 1].is_swap and order[index - 1].chunk == step.chunk)


@settings(max_examples=80, deadline=None)
@given(config=swap_configs())
def test_the_peak_policy_keeps_each_ranks_peak_with_needed_chunks_only(
    config: ScheduleConfig,
) -> None:
    """``swap_policy="peak"``: a subset of the gap rule's chunks per rank, each needed for
    the gap rule's peak (``simulate.memory_profile`` of the built orders, not the windows
    the policy computes with); the orders validate and strip to the plain ones."""
    plain = build_all_orders(replace(config, swap=False))
    gap = build_all_orders(config)
    peak = planned_orders(config, "peak")  # validated
    assert tuple(strip_swap_steps(order) for order in peak) == plain
    for rank, chosen in enumerate(peak_chunks(config, plain)):
        assert eligible_chunks(peak[rank]) == chosen <= eligible_chunks(gap[rank])
        assert max(memory_profile(peak[rank])) == max(memory_profile(gap[rank]))
        for chunk in chosen:  # each one holds the peak down
            without = inject_swap_steps(plain[rank], config, rank, chunks=chosen - {chunk})
            assert max(memory_profile(without)) > max(memory_profile(peak[rank]))
