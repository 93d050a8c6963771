"""Validation: each invariant is caught; the simulation finds deadlocks and shows them."""

from __future__ import annotations

import pytest

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders, build_exec_order
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.steps import MetaStep, Order, StepKind
from ppswap.scheduler.validate import (
    ScheduleDeadlockError,
    ScheduleValidationError,
    simulate_progress,
    validate_all,
    validate_order,
    validate_p2p_pairs,
)

K = StepKind


def replace_at(order: Order, index: int, *steps: MetaStep) -> Order:
    return order[:index] + steps + order[index + 1 :]


def index_of(order: Order, step: MetaStep) -> int:
    return order.index(step)


ONE_F_ONE_B = ScheduleConfig(schedule="1f1b", pp=2, micro=3)


def test_errors_are_value_errors() -> None:
    assert issubclass(ScheduleValidationError, ValueError)
    assert issubclass(ScheduleDeadlockError, ScheduleValidationError)


# -- per-rank invariants (compute orders) ----------------------------------------------------------
@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda o: o[1:], "no FWD"),
        (lambda o: (*o, o[0]), "appears twice"),
        (lambda o: tuple(s for s in o if s != MetaStep(K.BWD, 0, 2)), "needs one BWD"),
        (
            lambda o: (MetaStep(K.BWD, 0, 0), *(s for s in o if s != MetaStep(K.BWD, 0, 0))),
            "must come before",
        ),
        (lambda o: (*o, MetaStep(K.FWD, 1, 3)), "not on rank 0"),
        (lambda o: (*o[:-1], MetaStep(K.FWD, 0, 3)), "micro must be in 0..2"),
        (lambda o: (*o, MetaStep(K.SEND_F, 0, 0, 1)), "compute slots only"),
    ],
)
def test_validate_order_catches_broken_compute_orders(mutate: object, message: str) -> None:
    order = compute_order(ONE_F_ONE_B, 0)
    validate_order(ONE_F_ONE_B, 0, order, lowered=False)
    with pytest.raises(ScheduleValidationError, match=message):
        validate_order(ONE_F_ONE_B, 0, mutate(order), lowered=False)  # type: ignore[operator]


def test_split_rules_are_checked() -> None:
    split = ScheduleConfig(schedule="1f1b", pp=2, micro=2, split_dw=True)
    order = compute_order(split, 1)
    weight = MetaStep(K.BWD_WEIGHT, 1, 0)
    first = MetaStep(K.BWD_INPUT, 1, 0)
    # BWD_WEIGHT before its BWD_INPUT
    swapped = tuple(weight if s == first else first if s == weight else s for s in order)
    with pytest.raises(ScheduleValidationError, match=r"BWD_INPUT .* must come before"):
        validate_order(split, 1, swapped, lowered=False)
    # a split without split_dw
    with pytest.raises(ScheduleValidationError, match="need split_dw=True"):
        validate_order(ScheduleConfig(schedule="1f1b", pp=2, micro=2), 1, order, lowered=False)
    # stage 0 never splits
    rank0 = tuple(
        MetaStep(K.BWD_INPUT, 0, s.micro) if s.kind is K.BWD else s for s in compute_order(split, 0)
    ) + tuple(MetaStep(K.BWD_WEIGHT, 0, m) for m in range(2))
    with pytest.raises(ScheduleValidationError, match="stage 0 keeps a unified BWD"):
        validate_order(split, 0, rank0, lowered=False)


def test_composites_need_overlap_and_the_right_shape() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=2, micro=3, overlap_b_f=True)
    order = compute_order(config, 1)
    validate_order(config, 1, order, lowered=False)
    with pytest.raises(ScheduleValidationError, match="need overlap_b_f=True"):
        validate_order(ScheduleConfig(schedule="1f1b", pp=2, micro=3), 1, order, lowered=False)
    index = next(i for i, s in enumerate(order) if s.kind is K.OVERLAP_B_F)
    back, fwd = order[index].sub_steps
    reversed_pair = MetaStep(K.OVERLAP_B_F, fwd.stage, fwd.micro, sub_steps=(fwd, back))
    with pytest.raises(ScheduleValidationError, match=r"OVERLAP_B_F\(BWD or BWD_INPUT, FWD\)"):
        validate_order(config, 1, replace_at(order, index, reversed_pair), lowered=False)


def test_forward_only_rejects_backwards() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=1, micro=2, forward_only=True)
    with pytest.raises(ScheduleValidationError, match="forward-only"):
        validate_order(config, 0, (*compute_order(config, 0), MetaStep(K.BWD, 0, 0)), lowered=False)


# -- per-rank invariants (lowered orders) -------------------------------------------------------
def test_a_missing_or_misplaced_p2p_step_is_caught() -> None:
    order = build_exec_order(ONE_F_ONE_B, 1)
    recv = MetaStep(K.RECV_F, 1, 1, 0)
    index = index_of(order, recv)
    with pytest.raises(ScheduleValidationError, match=r"missing RF1\.1"):
        validate_order(ONE_F_ONE_B, 1, replace_at(order, index))
    wrong_peer = MetaStep(K.RECV_F, 1, 1, 1)
    with pytest.raises(ScheduleValidationError, match=r"unexpected RF1\.1"):
        validate_order(ONE_F_ONE_B, 1, replace_at(order, index, wrong_peer))
    # moved one gap later: same multiset overall, wrong gap
    moved = replace_at(order, index)
    consumer = index_of(moved, MetaStep(K.FWD, 1, 1))
    moved = (*moved[: consumer + 1], recv, *moved[consumer + 1 :])
    with pytest.raises(ScheduleValidationError, match="do not match the data dependencies"):
        validate_order(ONE_F_ONE_B, 1, moved)


def test_batch_mode_shape_is_checked() -> None:
    batch = ScheduleConfig(schedule="1f1b", pp=2, micro=3, p2p="batch")
    plain_order = build_exec_order(ONE_F_ONE_B, 0)
    with pytest.raises(ScheduleValidationError, match="must be fused"):
        validate_order(batch, 0, plain_order)
    batch_order = build_exec_order(batch, 0)
    with pytest.raises(ScheduleValidationError, match="only with p2p='batch'"):
        validate_order(ONE_F_ONE_B, 0, batch_order)
    lone = MetaStep(K.BATCH_SEND_RECV, 0, 0, sub_steps=(MetaStep(K.SEND_F, 0, 0, 1),))
    index = index_of(batch_order, MetaStep(K.SEND_F, 0, 0, 1))
    with pytest.raises(ScheduleValidationError, match="two or more"):
        validate_order(batch, 0, replace_at(batch_order, index, lone))


def test_fsdp_states_are_checked() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=2, fsdp=True)
    order = build_exec_order(config, 0)
    unshard = MetaStep(K.FSDP_UNSHARD, 0, -1)
    reshard = MetaStep(K.FSDP_RESHARD, 0, -1)
    with pytest.raises(ScheduleValidationError, match="sharded"):
        validate_order(config, 0, order[1:])  # first FWD runs sharded
    with pytest.raises(ScheduleValidationError, match="still unsharded"):
        validate_order(config, 0, order[:-1])
    with pytest.raises(ScheduleValidationError, match="already unsharded"):
        validate_order(config, 0, (unshard, *order))
    with pytest.raises(ScheduleValidationError, match="while it is sharded"):
        validate_order(config, 0, (*order, reshard))
    with pytest.raises(ScheduleValidationError, match="need fsdp=True"):
        validate_order(ScheduleConfig(schedule="gpipe", pp=2, micro=2), 0, order)


def test_swap_steps_need_swap() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=1, micro=6, swap=True)
    order = build_exec_order(config, 0)
    assert any(step.is_swap for step in order)
    validate_order(config, 0, order)
    with pytest.raises(ScheduleValidationError, match="need swap=True"):
        validate_order(ScheduleConfig(schedule="gpipe", pp=1, micro=6), 0, order)


# -- cross-rank pairing ----------------------------------------------------------------------------
def test_pairs_out_of_order_on_a_channel_are_caught() -> None:
    orders = list(build_all_orders(ONE_F_ONE_B))
    validate_p2p_pairs(ONE_F_ONE_B, orders)
    # rank 1 receives micro 1 before micro 0 (each recv still before its own consumer
    # would be impossible; this only tests the pairing check itself)
    first = index_of(orders[1], MetaStep(K.RECV_F, 1, 0, 0))
    second = index_of(orders[1], MetaStep(K.RECV_F, 1, 1, 0))
    swapped = list(orders[1])
    swapped[first], swapped[second] = swapped[second], swapped[first]
    orders[1] = tuple(swapped)
    with pytest.raises(
        ScheduleValidationError, match=r"channel rank 0 -> rank 1 \(F\): message #0"
    ):
        validate_p2p_pairs(ONE_F_ONE_B, orders)


def test_a_send_without_its_receive_is_caught() -> None:
    orders = list(build_all_orders(ONE_F_ONE_B))
    orders[1] = tuple(s for s in orders[1] if s != MetaStep(K.RECV_F, 1, 2, 0))
    with pytest.raises(ScheduleValidationError, match="no receive"):
        validate_p2p_pairs(ONE_F_ONE_B, orders)


def test_a_wrong_peer_is_caught() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=3, micro=2)
    orders = list(build_all_orders(config))
    index = index_of(orders[1], MetaStep(K.SEND_F, 1, 0, 2))
    orders[1] = replace_at(orders[1], index, MetaStep(K.SEND_F, 1, 0, 0))
    with pytest.raises(ScheduleValidationError, match="no partner stage"):
        validate_p2p_pairs(config, orders)


def test_orders_must_cover_every_rank() -> None:
    with pytest.raises(ValueError, match="one order per rank"):
        validate_all(ONE_F_ONE_B, build_all_orders(ONE_F_ONE_B)[:1])


# -- simulation -----------------------------------------------------------------------------------
def test_simulation_reports_a_deadlock_with_a_marked_grid() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=3, micro=4)
    orders = list(build_all_orders(config))
    simulate_progress(config, orders)
    # rank 0 now waits for the gradient of micro 0 before it sends micro 0 forward
    send = MetaStep(K.SEND_F, 0, 0, 1)
    recv = MetaStep(K.RECV_B, 0, 0, 1)
    rank0 = tuple(s for s in orders[0] if s != send)
    at = index_of(rank0, recv) + 1
    orders[0] = (*rank0[:at], send, *rank0[at:])
    with pytest.raises(ScheduleDeadlockError) as caught:
        simulate_progress(config, orders)
    message = str(caught.value)
    assert caught.value.stuck == {0: index_of(orders[0], recv), 1: 0, 2: 0}
    assert "rank 0 waits at step" in message
    assert "SEND_B(stage 1, micro 0) from rank 1 to rank 0" in message
    assert "rank 1 waits at step 0 (RF0.1)" in message
    assert "rank 0 |" in message and ">>RB0.0" in message and ">>RF0.1" in message


def reverse_gap_after(order: Order, producer: MetaStep) -> Order:
    """Reverse the P2P content of the gap right after ``producer`` (one step or a batch)."""
    at = index_of(order, producer) + 1
    step = order[at]
    if step.kind is K.BATCH_SEND_RECV:
        flipped = MetaStep(step.kind, step.stage, step.micro, sub_steps=step.sub_steps[::-1])
        return replace_at(order, at, flipped)
    return (*order[:at], order[at + 1], order[at], *order[at + 2 :])


def test_batch_posts_its_sends_before_waiting() -> None:
    # GPipe pp=2: after its last FWD rank 0 sends F2 and receives B0, and rank 1 can only
    # run B0 after F2. Receiving first deadlocks in plain mode; a batch posts its sends
    # before waiting, whatever the order inside it.
    last_fwd = MetaStep(K.FWD, 0, 2)
    plain = ScheduleConfig(schedule="gpipe", pp=2, micro=3)
    orders = list(build_all_orders(plain))
    assert text(orders[0][index_of(orders[0], last_fwd) + 1 :][:2]) == "SF2.0 RB0.0"
    orders[0] = reverse_gap_after(orders[0], last_fwd)
    with pytest.raises(ScheduleDeadlockError):
        simulate_progress(plain, orders)
    batch = ScheduleConfig(schedule="gpipe", pp=2, micro=3, p2p="batch")
    orders = list(build_all_orders(batch))
    orders[0] = reverse_gap_after(orders[0], last_fwd)
    assert "BATCH[RB0.0+SF2.0]" in text(orders[0])
    simulate_progress(batch, orders)


def text(order: Order) -> str:
    return " ".join(step.short() for step in order)


def test_a_receive_nobody_sends_is_named() -> None:
    orders = list(build_all_orders(ONE_F_ONE_B))
    orders[0] = tuple(s for s in orders[0] if s != MetaStep(K.SEND_F, 0, 1, 1))
    with pytest.raises(ScheduleDeadlockError, match="no rank's order contains it"):
        simulate_progress(ONE_F_ONE_B, orders)
