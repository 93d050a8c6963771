"""Compute orders: Megatron-LM equality, warm-up counts, split_dw, overlap_b_f, refusals."""

from __future__ import annotations

import itertools

import pytest

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.schedules import (
    backward_chunks,
    compute_order,
    forward_chunks,
    warmup_count,
    weight_lag,
)
from ppswap.scheduler.steps import MetaStep, Order, StepKind, iter_leaves
from ppswap.scheduler.validate import validate_order

F, B, BI, BW = StepKind.FWD, StepKind.BWD, StepKind.BWD_INPUT, StepKind.BWD_WEIGHT
BACKWARDS = (B, BI)


def text(order: Order) -> str:
    return " ".join(step.short() for step in order)


# -- independent references ---------------------------------------------------------------------
def megatron_1f1b(pp: int, micro: int, rank: int) -> list[tuple[StepKind, int, int]]:
    """forward_backward_pipelining_without_interleaving, written from Megatron-LM."""
    warmup = min(pp - rank - 1, micro)
    remaining = micro - warmup
    order = [(F, rank, i) for i in range(warmup)]
    for i in range(remaining):
        order.append((F, rank, warmup + i))
        order.append((B, rank, i))
    order.extend((B, rank, i) for i in range(remaining, micro))
    return order


def megatron_interleaved(
    pp: int, vpp: int, micro: int, rank: int
) -> list[tuple[StepKind, int, int]]:
    """forward_backward_pipelining_with_interleaving (get_model_chunk_id and the
    micro-batch id of the virtual micro-batch), written from Megatron-LM."""
    total = micro * vpp

    def chunk_id(k: int, forward: bool) -> int:
        chunk = (k % (pp * vpp)) // pp
        return chunk if forward else vpp - chunk - 1

    def micro_id(k: int) -> int:
        return (k // (pp * vpp)) * pp + k % pp

    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    remaining = total - warmup
    fwd = [(F, chunk_id(k, True) * pp + rank, micro_id(k)) for k in range(total)]
    bwd = [(B, chunk_id(k, False) * pp + rank, micro_id(k)) for k in range(total)]
    order = fwd[:warmup]
    for k in range(remaining):
        order.append(fwd[warmup + k])
        order.append(bwd[k])
    order.extend(bwd[remaining:])
    return order


def as_tuples(order: Order) -> list[tuple[StepKind, int, int]]:
    assert all(not step.sub_steps for step in order)
    return [(step.kind, step.stage, step.micro) for step in order]


def flatten_composites(order: Order) -> Order:
    return tuple(iter_leaves(order))


# -- hand-checked orders ----------------------------------------------------------------------
def test_gpipe_runs_all_forwards_then_all_backwards_in_micro_order() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=3, micro=3)
    assert text(compute_order(config, 1)) == "F0.1 F1.1 F2.1 B0.1 B1.1 B2.1"


def test_1f1b_pp4_m6_hand_checked() -> None:
    # warm-up 3, 2, 1, 0; steady F(w+k) B(k); cool-down the last w backwards.
    config = ScheduleConfig(schedule="1f1b", pp=4, micro=6)
    orders = [text(compute_order(config, rank)) for rank in range(4)]
    assert orders[0] == "F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 B3.0 B4.0 B5.0"
    assert orders[1] == "F0.1 F1.1 F2.1 B0.1 F3.1 B1.1 F4.1 B2.1 F5.1 B3.1 B4.1 B5.1"
    assert orders[3] == "F0.3 B0.3 F1.3 B1.3 F2.3 B2.3 F3.3 B3.3 F4.3 B4.3 F5.3 B5.3"


def test_interleaved_pp2_vpp2_m4_hand_checked() -> None:
    # Table: (m0,c0)(m1,c0)(m0,c1)(m1,c1)(m2,c0)(m3,c0)(m2,c1)(m3,c1); stage = c*2 + rank.
    # Rank 0 warm-up (2-0-1)*2 + (2-1)*2 = 4; backward chunk reversed (c -> 1 - c).
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=4)
    assert text(compute_order(config, 0)) == (
        "F0.0 F1.0 F0.2 F1.2 F2.0 B0.2 F3.0 B1.2 F2.2 B0.0 F3.2 B1.0 B2.2 B3.2 B2.0 B3.0"
    )
    assert forward_chunks(config, 1)[:4] == ((1, 0), (1, 1), (3, 0), (3, 1))
    assert backward_chunks(config, 1)[:4] == ((3, 0), (3, 1), (1, 0), (1, 1))


# -- Megatron equality and warm-up counts -------------------------------------------------------
@pytest.mark.parametrize("pp", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 7, 8, 16])
def test_1f1b_equals_megatron(pp: int, micro: int) -> None:
    config = ScheduleConfig(schedule="1f1b", pp=pp, micro=micro)
    for rank in range(pp):
        assert as_tuples(compute_order(config, rank)) == megatron_1f1b(pp, micro, rank)


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("vpp", [2, 3, 4])
@pytest.mark.parametrize("groups", [1, 2, 3])
def test_interleaved_equals_megatron(pp: int, vpp: int, groups: int) -> None:
    micro = groups * pp
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=pp, vpp=vpp, micro=micro)
    for rank in range(pp):
        expected = megatron_interleaved(pp, vpp, micro, rank)
        assert as_tuples(compute_order(config, rank)) == expected


def forwards_before_first_backward(order: Order) -> int:
    count = 0
    for leaf in iter_leaves(order):
        if leaf.kind in BACKWARDS:
            return count
        count += leaf.kind is F
    return count


WARMUP_GRID = [
    (schedule, pp, vpp, micro)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b")
    for pp in (1, 2, 3, 4, 8)
    for vpp in ((2, 3, 4) if schedule == "interleaved_1f1b" else (1,))
    for micro in ((pp, 2 * pp, 4 * pp) if schedule == "interleaved_1f1b" else (1, 2, 5, 8, 16))
]


@pytest.mark.parametrize(("schedule", "pp", "vpp", "micro"), WARMUP_GRID)
def test_warmup_counts(schedule: str, pp: int, vpp: int, micro: int) -> None:
    config = ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro)  # type: ignore[arg-type]
    for rank in range(pp):
        if schedule == "gpipe":
            expected = micro
        elif schedule == "1f1b":
            expected = min(pp - rank - 1, micro)
        else:
            expected = min((pp - rank - 1) * 2 + (vpp - 1) * pp, micro * vpp)
        order = compute_order(config, rank)
        assert warmup_count(config, rank) == expected
        # The first steady iteration runs one more FWD before the first backward.
        total = micro * vpp
        assert forwards_before_first_backward(order) == min(expected + 1, total)


# -- split_dw (ZB-H1) ----------------------------------------------------------------------------
def test_split_dw_keeps_unified_bwd_on_stage_0_only() -> None:
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=4, split_dw=True)
    for rank in range(2):
        for leaf in iter_leaves(compute_order(config, rank)):
            if leaf.kind is B:
                assert leaf.stage == 0
            if leaf.kind in (BI, BW):
                assert leaf.stage != 0


@pytest.mark.parametrize(
    ("schedule", "pp", "vpp", "micro"),
    [("gpipe", 4, 1, 6), ("1f1b", 4, 1, 8), ("1f1b", 5, 1, 3), ("interleaved_1f1b", 3, 2, 6)],
)
def test_split_dw_defers_weights_by_the_rank_lag(
    schedule: str, pp: int, vpp: int, micro: int
) -> None:
    config = ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro, split_dw=True)  # type: ignore[arg-type]
    for rank in range(pp):
        lag = weight_lag(config, rank)
        assert lag == (2 * rank if schedule == "interleaved_1f1b" else rank)
        order = compute_order(config, rank)
        pending: list[tuple[int, int]] = []
        for step in order:
            if step.kind is F:
                assert len(pending) <= lag  # never more than `lag` weights held back
            elif step.kind is BI:
                pending.append(step.chunk)
            elif step.kind is BW:
                assert pending.pop(0) == step.chunk  # FIFO: weights in backward order
        assert pending == []
        # After the last backward come only weights: the one its own push released plus
        # the `lag` held back (fewer when there are fewer split backwards).
        last_backward = max(i for i, s in enumerate(order) if s.kind in BACKWARDS)
        tail = order[last_backward + 1 :]
        splits = sum(1 for s in order if s.kind is BI)
        assert all(s.kind is BW for s in tail)
        expected_tail = 0 if order[last_backward].kind is B else min(lag + 1, splits)
        assert len(tail) == expected_tail


def live_peak(order: Order) -> int:
    live = peak = 0
    for leaf in iter_leaves(order):
        if leaf.kind is F:
            live += 1
            peak = max(peak, live)
        elif leaf.kind in (B, BW):
            live -= 1
    return peak


@pytest.mark.parametrize(
    ("schedule", "pp", "vpp", "micro"),
    [
        ("1f1b", 4, 1, 8),
        ("1f1b", 6, 1, 24),
        ("interleaved_1f1b", 4, 2, 8),
        ("interleaved_1f1b", 3, 3, 12),
    ],
)
def test_split_dw_stays_within_the_1f1b_peak(schedule: str, pp: int, vpp: int, micro: int) -> None:
    # ZB-H1: deferring `lag` weights keeps every rank's live chunks (FWD done, BWD or
    # BWD_WEIGHT not yet) within rank 0's peak without the split.
    plain = ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro)  # type: ignore[arg-type]
    split = ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro, split_dw=True)  # type: ignore[arg-type]
    bound = max(live_peak(compute_order(plain, rank)) for rank in range(pp))
    assert bound == live_peak(compute_order(plain, 0))
    for rank in range(pp):
        assert live_peak(compute_order(split, rank)) <= bound


# -- overlap_b_f -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("schedule", "pp", "vpp", "micro"),
    [("1f1b", 1, 1, 3), ("1f1b", 3, 1, 2), ("1f1b", 4, 1, 9), ("interleaved_1f1b", 2, 3, 6)],
)
def test_overlap_fuses_each_backward_followed_by_a_forward(
    schedule: str, pp: int, vpp: int, micro: int
) -> None:
    plain = ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro)  # type: ignore[arg-type]
    fused = ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro, overlap_b_f=True)  # type: ignore[arg-type]
    for rank in range(pp):
        base = compute_order(plain, rank)
        order = compute_order(fused, rank)
        assert flatten_composites(order) == base
        pairs = sum(1 for a, b in itertools.pairwise(base) if a.kind is B and b.kind is F)
        composites = [s for s in order if s.kind is StepKind.OVERLAP_B_F]
        assert len(composites) == pairs
        for composite in composites:
            back, fwd = composite.sub_steps
            assert back.kind is B and fwd.kind is F and back.chunk != fwd.chunk
            assert composite.chunk == back.chunk
        if schedule == "1f1b":
            assert pairs == max(micro - warmup_count(plain, rank) - 1, 0)


def test_overlap_with_split_puts_the_weight_right_after_its_composite() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=3, micro=6, overlap_b_f=True, split_dw=True)
    for rank in range(3):
        order = compute_order(config, rank)
        for index, step in enumerate(order):
            if step.kind is StepKind.OVERLAP_B_F and step.sub_steps[0].kind is BI:
                assert order[index + 1] == MetaStep(BW, *step.sub_steps[0].chunk)
        validate_order(config, rank, order, lowered=False)


def test_gpipe_with_overlap_is_refused() -> None:
    with pytest.raises(ValueError, match="overlap_b_f"):
        ScheduleConfig(schedule="gpipe", pp=2, micro=4, overlap_b_f=True)


# -- forward-only, micro < pp, bad input -------------------------------------------------------
@pytest.mark.parametrize(
    ("schedule", "pp", "vpp", "micro"),
    [("gpipe", 2, 1, 3), ("1f1b", 4, 1, 2), ("interleaved_1f1b", 2, 2, 4)],
)
def test_forward_only_has_only_forwards_in_forward_order(
    schedule: str, pp: int, vpp: int, micro: int
) -> None:
    config = ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro, forward_only=True)  # type: ignore[arg-type]
    for rank in range(pp):
        order = compute_order(config, rank)
        assert all(step.kind is F for step in order)
        assert tuple(step.chunk for step in order) == forward_chunks(config, rank)
        assert len(order) == micro * vpp


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_micro_below_pp_gives_valid_orders(schedule: str) -> None:
    config = ScheduleConfig(schedule=schedule, pp=6, micro=2)  # type: ignore[arg-type]
    for rank in range(6):
        validate_order(config, rank, compute_order(config, rank), lowered=False)


def test_interleaved_micro_below_pp_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="micro must be a multiple of pp=4"):
        ScheduleConfig(schedule="interleaved_1f1b", pp=4, vpp=2, micro=2)


@pytest.mark.parametrize(
    ("rank", "error"), [(-1, ValueError), (2, ValueError), (True, TypeError), ("0", TypeError)]
)
def test_bad_rank_is_refused(rank: object, error: type[Exception]) -> None:
    config = ScheduleConfig(schedule="1f1b", pp=2, micro=2)
    with pytest.raises(error, match=r"rank must be an int in 0\.\.1"):
        compute_order(config, rank)  # type: ignore[arg-type]
