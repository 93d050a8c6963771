"""Swap planner on hand-built orders: the gap rule (one test per gap), leaves, pairing, errors.

Every expected order here was worked out by hand from the placement rules in the
``ppswap.scheduler.swap_plan`` module docstring.
"""

from __future__ import annotations

import pytest

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import MetaStep, Order, StepKind
from ppswap.scheduler.swap_plan import (
    SwapChunkPlan,
    compute_slots,
    eligible_chunks,
    inject_swap_steps,
    plan_swap,
    strip_swap_steps,
)

K = StepKind


def step(kind: StepKind, stage: int, micro: int, peer: int | None = None) -> MetaStep:
    return MetaStep(kind, stage, micro, peer=peer)


def text(order: Order) -> str:
    return " ".join(s.short() for s in order)


def gpipe_one_stage(micro: int) -> Order:
    """F0..F(m-1) B0..B(m-1) on one stage: every chunk has gap == micro."""
    return tuple(step(K.FWD, 0, i) for i in range(micro)) + tuple(
        step(K.BWD, 0, i) for i in range(micro)
    )


def config(micro: int = 4, min_swap_gap: int = 4, **kw: object) -> ScheduleConfig:
    return ScheduleConfig(
        schedule="gpipe", pp=1, micro=micro, swap=True, min_swap_gap=min_swap_gap, **kw
    )  # type: ignore[arg-type]


# -- the gap rule: one test per gap ------------------------------------------------------


def test_gap_1_is_never_eligible() -> None:
    order = (step(K.FWD, 0, 0), step(K.BWD, 0, 0), step(K.FWD, 0, 1), step(K.BWD, 0, 1))
    for min_gap in (2, 3, 4):
        cfg = config(micro=2, min_swap_gap=min_gap)
        plans = plan_swap(order, cfg)
        assert [p.gap for p in plans] == [1, 1]
        assert not any(p.eligible for p in plans)
        assert inject_swap_steps(order, cfg, 0) == order


def test_gap_2_not_eligible_by_default() -> None:
    order = gpipe_one_stage(2)
    assert [p.gap for p in plan_swap(order, config(micro=2))] == [2, 2]
    assert inject_swap_steps(order, config(micro=2), 0) == order


def test_gap_2_with_min_gap_2_frees_and_reloads_at_once() -> None:
    # Storage released at WAIT_OFFLOAD is re-requested by the very next step: no benefit,
    # which is why the default min_swap_gap keeps gap 2 out.
    out = inject_swap_steps(gpipe_one_stage(2), config(micro=2, min_swap_gap=2), 0)
    assert text(out) == "F0.0 LO0.0 F1.0 LO1.0 WO0.0 LL0.0 WL0.0 B0.0 WO1.0 LL1.0 WL1.0 B1.0"


def test_gap_3_not_eligible_by_default() -> None:
    order = gpipe_one_stage(3)
    assert all(p.gap == 3 and not p.eligible for p in plan_swap(order, config(micro=3)))
    assert inject_swap_steps(order, config(micro=3), 0) == order


def test_gap_3_with_min_gap_3_has_one_edge_window() -> None:
    # The load of chunk 0 is launched right after its offload wait, covered by F2 alone.
    out = inject_swap_steps(gpipe_one_stage(3), config(micro=3, min_swap_gap=3), 0)
    assert text(out) == (
        "F0.0 LO0.0 F1.0 LO1.0 WO0.0 LL0.0 F2.0 LO2.0 WO1.0 LL1.0 WL0.0 B0.0 "
        "WO2.0 LL2.0 WL1.0 B1.0 WL2.0 B2.0"
    )


def test_gap_4_injects_full_life_cycle_with_one_free_slot() -> None:
    out = inject_swap_steps(gpipe_one_stage(4), config(micro=4), 0)
    assert text(out) == (
        "F0.0 LO0.0 F1.0 LO1.0 WO0.0 F2.0 LO2.0 WO1.0 LL0.0 F3.0 LO3.0 WO2.0 LL1.0 WL0.0 "
        "B0.0 WO3.0 LL2.0 WL1.0 B1.0 LL3.0 WL2.0 B2.0 WL3.0 B3.0"
    )
    # F2 runs with chunk 0 on the host: between its WAIT_OFFLOAD and LAUNCH_LOAD.
    names = [s.short() for s in out]
    assert names.index("WO0.0") < names.index("F2.0") < names.index("LL0.0")


@pytest.mark.parametrize("gap", [4, 5, 7])
def test_gap_at_least_4_eligible(gap: int) -> None:
    plans = plan_swap(gpipe_one_stage(gap), config(micro=gap))
    assert all(p.gap == gap and p.eligible for p in plans)
    assert eligible_chunks(inject_swap_steps(gpipe_one_stage(gap), config(micro=gap), 0)) == {
        (0, i) for i in range(gap)
    }


@pytest.mark.parametrize("min_gap", [2, 3, 4, 5, 6])
def test_min_swap_gap_is_the_threshold(min_gap: int) -> None:
    for gap in range(1, 8):
        plans = plan_swap(gpipe_one_stage(gap), config(micro=gap, min_swap_gap=min_gap))
        assert all(p.eligible == (gap >= min_gap) for p in plans)


# -- leaves, slots and pairing ----------------------------------------------------------


def test_composite_counts_as_one_slot() -> None:
    order = (
        step(K.FWD, 0, 0),
        step(K.FWD, 0, 1),
        MetaStep(K.OVERLAP_B_F, 0, 0, sub_steps=(step(K.BWD, 0, 0), step(K.FWD, 0, 2))),
        step(K.BWD, 0, 1),
        step(K.BWD, 0, 2),
    )
    slots = compute_slots(order)
    assert [s.slot for s in slots] == [0, 1, 2, 3, 4]
    assert [len(s.leaves) for s in slots] == [1, 1, 2, 1, 1]
    plans = {p.chunk: p for p in plan_swap(order, config(micro=3))}
    assert plans[(0, 0)] == SwapChunkPlan(0, 0, 0, 2, 2, False)
    assert plans[(0, 2)].fwd_slot == 2 and plans[(0, 2)].gap == 2


def test_compute_slots_skip_communication() -> None:
    order = (
        step(K.RECV_F, 1, 0, peer=0),
        step(K.FWD, 1, 0),
        MetaStep(K.BATCH_SEND_RECV, 1, 0, sub_steps=(step(K.SEND_F, 1, 0, peer=2),)),
        step(K.FSDP_RESHARD, 1, -1),
        step(K.BWD, 1, 0),
    )
    assert [(s.slot, s.index) for s in compute_slots(order)] == [(0, 1), (1, 4)]


def test_dxdw_pairs_with_bwd_input_and_weight_never_loads() -> None:
    order = gpipe_one_stage(4)[:4] + tuple(
        s for i in range(4) for s in (step(K.BWD_INPUT, 0, i), step(K.BWD_WEIGHT, 0, i))
    )
    plans = plan_swap(order, config(micro=4))
    assert [(p.fwd_slot, p.consumer_slot) for p in plans] == [(0, 4), (1, 6), (2, 8), (3, 10)]
    out = inject_swap_steps(order, config(micro=4), 0)
    for i in range(4):
        names = [s.short() for s in out]
        assert names[names.index(f"I{i}.0") - 1] == f"WL{i}.0"
        # nothing of the swap life cycle sits right before BWD_WEIGHT for its own chunk
        assert names[names.index(f"W{i}.0") - 1] != f"WL{i}.0"
    assert sum(s.kind is K.SWAP_WAIT_LOAD for s in out) == 4


def test_plans_are_in_fwd_order() -> None:
    plans = plan_swap(gpipe_one_stage(5), config(micro=5))
    assert [p.micro for p in plans] == [0, 1, 2, 3, 4]


def test_strip_and_eligible_chunks_round_trip() -> None:
    order = gpipe_one_stage(6)
    out = inject_swap_steps(order, config(micro=6), 0)
    assert strip_swap_steps(out) == order
    assert len(out) == len(order) + 4 * 6
    assert eligible_chunks(order) == frozenset()


def test_swap_false_is_identity() -> None:
    cfg = ScheduleConfig(schedule="gpipe", pp=1, micro=6)
    assert inject_swap_steps(gpipe_one_stage(6), cfg, 0) == gpipe_one_stage(6)


# -- errors -----------------------------------------------------------------------------


def test_order_must_be_tuple_of_steps() -> None:
    with pytest.raises(TypeError, match="order must be a tuple of MetaStep"):
        inject_swap_steps(list(gpipe_one_stage(2)), config(micro=2), 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="config must be a ScheduleConfig"):
        plan_swap(gpipe_one_stage(2), {"swap": True})  # type: ignore[arg-type]


@pytest.mark.parametrize("rank", [-1, 1, 5])
def test_rank_out_of_range(rank: int) -> None:
    with pytest.raises(ValueError, match=rf"rank must be an int in 0\.\.0, got {rank}"):
        inject_swap_steps(gpipe_one_stage(2), config(micro=2), rank)


def test_rank_not_int() -> None:
    with pytest.raises(TypeError, match="rank must be an int"):
        inject_swap_steps(gpipe_one_stage(2), config(micro=2), True)


def test_leaf_of_another_rank_is_refused() -> None:
    cfg = ScheduleConfig(schedule="gpipe", pp=2, micro=1, swap=True)
    with pytest.raises(ValueError, match="lives on rank 1"):
        inject_swap_steps((step(K.FWD, 1, 0), step(K.BWD, 1, 0)), cfg, 0)


def test_duplicate_fwd_refused() -> None:
    order = (step(K.FWD, 0, 0), step(K.FWD, 0, 0), step(K.BWD, 0, 0))
    with pytest.raises(ValueError, match=r"two FWD steps for chunk .* \(0, 0\)"):
        plan_swap(order, config(micro=1))


def test_fwd_without_consumer_refused() -> None:
    with pytest.raises(ValueError, match="has a FWD but no BWD/BWD_INPUT consumer"):
        plan_swap((step(K.FWD, 0, 0),), config(micro=1))


def test_consumer_without_fwd_refused() -> None:
    with pytest.raises(ValueError, match="has a backward but no FWD"):
        plan_swap((step(K.BWD, 0, 0),), config(micro=1))


def test_consumer_before_fwd_refused() -> None:
    with pytest.raises(ValueError, match="comes before its FWD"):
        plan_swap((step(K.BWD, 0, 0), step(K.FWD, 0, 0)), config(micro=1))


def test_already_swapped_order_refused() -> None:
    out = inject_swap_steps(gpipe_one_stage(4), config(micro=4), 0)
    with pytest.raises(ValueError, match="must not hold swap steps already"):
        inject_swap_steps(out, config(micro=4), 0)


# -- bad configuration (ScheduleConfig refuses it before anything runs) ------------------


@pytest.mark.parametrize("bad", [0, 1, -3])
def test_min_swap_gap_below_2(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"min_swap_gap must be an int >= 2, got {bad}"):
        ScheduleConfig(swap=True, min_swap_gap=bad)


@pytest.mark.parametrize("bad", [4.0, "4", True, None])
def test_min_swap_gap_not_int(bad: object) -> None:
    with pytest.raises(TypeError, match="min_swap_gap must be an int >= 2"):
        ScheduleConfig(swap=True, min_swap_gap=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [1, 0, "yes", None])
def test_swap_not_bool(bad: object) -> None:
    with pytest.raises(TypeError, match="swap must be a bool"):
        ScheduleConfig(swap=bad)  # type: ignore[arg-type]


def test_swap_with_forward_only() -> None:
    with pytest.raises(ValueError, match="swap must be False for a forward-only run"):
        ScheduleConfig(swap=True, forward_only=True)
