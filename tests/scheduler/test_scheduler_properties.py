"""Property tests over pp 1..8, vpp 1..4, micro 1..32, every flag, P2P mode and FSDP."""

from __future__ import annotations

import copy

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_exec_order, inject_fsdp_steps, rewrite_p2p
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.steps import MetaStep, Order, StepKind
from ppswap.scheduler.swap_plan import inject_swap_steps
from ppswap.scheduler.validate import (
    ScheduleDeadlockError,
    simulate_progress,
    validate_all,
    validate_order,
)

K = StepKind


@st.composite
def configs(
    draw: st.DrawFn,
    modes: tuple[str, ...] = ("plain", "batch", "boundary"),
    with_backward: bool = False,
) -> ScheduleConfig:
    schedule = draw(st.sampled_from(["gpipe", "1f1b", "interleaved_1f1b"]))
    pp = draw(st.integers(1, 8))
    if schedule == "interleaved_1f1b":
        vpp = draw(st.integers(2, 4))
        micro = pp * draw(st.integers(1, max(1, 32 // pp)))
    else:
        vpp = 1
        micro = draw(st.integers(1, 32))
    forward_only = not with_backward and draw(st.booleans())
    backward_flags = not forward_only
    return ScheduleConfig(
        schedule=schedule,  # type: ignore[arg-type]
        pp=pp,
        vpp=vpp,
        micro=micro,
        split_dw=backward_flags and draw(st.booleans()),
        overlap_b_f=backward_flags and schedule != "gpipe" and draw(st.booleans()),
        p2p=draw(st.sampled_from(modes)),  # type: ignore[arg-type]
        fsdp=draw(st.booleans()),
        swap=backward_flags and draw(st.booleans()),
        min_swap_gap=draw(st.integers(2, 6)),
        forward_only=forward_only,
    )


PROPERTY_SETTINGS = settings(max_examples=200, deadline=None)


@PROPERTY_SETTINGS
@given(configs())
def test_every_lowered_order_validates_and_the_simulation_completes(
    config: ScheduleConfig,
) -> None:
    orders = tuple(build_exec_order(config, rank) for rank in range(config.pp))
    event(f"steps: {10 ** len(str(sum(map(len, orders))))} or fewer")
    validate_all(config, orders)  # per-rank invariants, pairing, and progress


@PROPERTY_SETTINGS
@given(configs())
def test_lowering_never_mutates_and_is_deterministic(config: ScheduleConfig) -> None:
    for rank in range(config.pp):
        compute = compute_order(config, rank)
        validate_order(config, rank, compute, lowered=False)
        snapshot = copy.deepcopy(compute)
        with_fsdp = inject_fsdp_steps(compute, config, rank)
        assert compute == snapshot
        fsdp_snapshot = copy.deepcopy(with_fsdp)
        with_p2p = rewrite_p2p(with_fsdp, config, rank)
        assert with_fsdp == fsdp_snapshot
        p2p_snapshot = copy.deepcopy(with_p2p)
        final = inject_swap_steps(with_p2p, config, rank) if config.swap else with_p2p
        assert with_p2p == p2p_snapshot
        assert compute_order(config, rank) == compute
        assert build_exec_order(config, rank) == final


def break_first_backward_handoff(order: Order) -> Order:
    """Move stage 0's SEND_F of micro i after rank 0's first RECV_B (of micro i).

    Whatever stage that RECV_B is for, its gradient comes from a backward that needs the
    forward of stage 1 for micro i, which needs exactly that send: a cycle.
    """
    recv_at = next(i for i, step in enumerate(order) if step.kind is K.RECV_B)
    micro = order[recv_at].micro
    send = next(s for s in order if s.kind is K.SEND_F and s.stage == 0 and s.micro == micro)
    without = tuple(step for step in order if step != send)
    at = without.index(order[recv_at]) + 1
    return (*without[:at], send, *without[at:])


@settings(max_examples=100, deadline=None)
@given(configs(modes=("plain", "boundary"), with_backward=True))
def test_a_swapped_send_recv_is_caught_as_a_deadlock(config: ScheduleConfig) -> None:
    assume(config.num_stages >= 2)
    orders = [build_exec_order(config, rank) for rank in range(config.pp)]
    orders[0] = break_first_backward_handoff(orders[0])
    with pytest.raises(ScheduleDeadlockError) as caught:
        simulate_progress(config, orders)
    assert 0 in caught.value.stuck
    assert ">>" in str(caught.value)


def test_the_broken_order_is_still_a_permutation() -> None:
    # The deadlock test must only reorder: same steps, one moved.
    config = ScheduleConfig(schedule="1f1b", pp=2, micro=3)
    order = build_exec_order(config, 0)
    broken = break_first_backward_handoff(order)
    assert sorted(map(repr, broken)) == sorted(map(repr, order)) and broken != order
    assert (
        broken.index(MetaStep(K.SEND_F, 0, 0, 1)) == broken.index(MetaStep(K.RECV_B, 0, 0, 1)) + 1
    )
