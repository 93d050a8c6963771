"""The shared reading of orders (``ppswap.scheduler.analysis``): compute slots, the dependency
rule, the transfers it implies, P2P pairing, and that validation derives its expectations
from it rather than from lowering."""

from __future__ import annotations

import pytest

from ppswap.scheduler import lowering, simulate, swap_plan
from ppswap.scheduler.analysis import (
    check_orders,
    compute_slots,
    consumer_kinds,
    data_flow,
    expected_p2p,
    leaf_dependency,
    message_key,
    p2p_partner_stage,
    slot_dependencies,
)
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel
from ppswap.scheduler.cost_simulation import simulate_run
from ppswap.scheduler.lowering import build_all_orders, build_exec_order
from ppswap.scheduler.simulate import build_timeline
from ppswap.scheduler.steps import P2P_KINDS, MetaStep, Order, StepKind, iter_leaves
from ppswap.scheduler.validate import ScheduleValidationError, validate_all, validate_order

K = StepKind

LOWERED = [
    ScheduleConfig(schedule="gpipe", pp=3, micro=4),
    ScheduleConfig(schedule="1f1b", pp=4, micro=6, p2p="batch"),
    ScheduleConfig(schedule="1f1b", pp=3, micro=5, split_dw=True, overlap_b_f=True),
    ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=3, micro=4, fsdp=True),
    ScheduleConfig(schedule="interleaved_1f1b", pp=1, vpp=2, micro=2),
    ScheduleConfig(schedule="gpipe", pp=2, micro=6, swap=True, p2p="boundary"),
]


def p2p_leaves(order: Order) -> list[MetaStep]:
    return [leaf for leaf in iter_leaves(order) if leaf.kind in P2P_KINDS]


# -- the rule ----------------------------------------------------------------------------------
def test_data_flows_up_for_forwards_and_down_for_backward_consumers() -> None:
    assert data_flow(K.FWD) == 1
    assert data_flow(K.BWD) == data_flow(K.BWD_INPUT) == -1
    assert data_flow(K.BWD_WEIGHT) == 0
    assert data_flow(K.SEND_F) == data_flow(K.FSDP_UNSHARD) == 0


def test_leaf_dependency_table() -> None:
    consumer = {(2, 0): K.BWD_INPUT}
    assert leaf_dependency(K.FWD, 0, 0, 3, consumer) is None
    assert leaf_dependency(K.FWD, 2, 0, 3, consumer) == (K.FWD, 1, 0)
    assert leaf_dependency(K.BWD, 2, 0, 3, consumer) == (K.FWD, 2, 0)  # the last stage: the loss
    assert leaf_dependency(K.BWD, 1, 0, 3, consumer) == (K.BWD_INPUT, 2, 0)
    assert leaf_dependency(K.BWD, 0, 1, 3, consumer) == (K.BWD, 1, 1)  # default: a BWD
    assert leaf_dependency(K.BWD_WEIGHT, 1, 0, 3, consumer) == (K.BWD_INPUT, 1, 0)
    assert consumer_kinds([MetaStep(K.BWD_INPUT, 2, 0), MetaStep(K.FWD, 2, 0)]) == consumer


def test_slot_dependencies_point_at_the_producing_slots() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=2)
    orders = build_all_orders(config)
    deps = slot_dependencies(config, [compute_slots(order) for order in orders])
    # rank 0: F0 F1 B0 B1; rank 1: F0 F1 B0 B1
    assert deps[0] == ((), (), ((1, 2),), ((1, 3),))
    assert deps[1] == (((0, 0),), ((0, 1),), ((1, 0),), ((1, 1),))


def test_a_missing_producer_is_named() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=1)
    slots = [(), compute_slots((MetaStep(K.FWD, 1, 0), MetaStep(K.BWD, 1, 0)))]
    with pytest.raises(ValueError, match=r"F0\.1 of rank 1 depends on FWD\(stage=0, micro=0\)"):
        slot_dependencies(config, slots)


@pytest.mark.parametrize("config", [c for c in LOWERED if not c.overlap_b_f], ids=str)
def test_timeline_and_step_simulation_read_the_same_dependencies(config: ScheduleConfig) -> None:
    """One device per rank, one second per leaf, no latency: the step simulation starts
    every slot at the column the timeline gives it (the same recurrence on the same rule)."""
    orders = build_all_orders(config)
    timeline = build_timeline(config, orders)
    cost = CostModel(chunk_bytes=0, d2h_gbps=1.0, h2d_gbps=1.0, leaf_s=1.0)
    starts = simulate_run(config, orders, cost).slot_times
    for cells, times in zip(timeline.cells, starts, strict=True):
        assert [float(cell.column) for cell in cells] == [start for start, _ in times]


# -- transfers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("config", LOWERED, ids=str)
def test_the_derived_transfers_are_what_lowering_emits(config: ScheduleConfig) -> None:
    """Two implementations, one from the rule and the placement, one in lowering's hot loop."""
    for rank, order in enumerate(build_all_orders(config)):
        for slot in compute_slots(order):
            assert expected_p2p(slot.leaves, config) == lowering.p2p_for_slot(slot.step, config)
        validate_order(config, rank, order)


def test_peers_come_from_the_placement() -> None:
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=2)
    # stage 1 lives on rank 1: its input comes from stage 0 (rank 0), its output goes to
    # stage 2 (rank 0 again)
    assert expected_p2p([MetaStep(K.FWD, 1, 0)], config) == (
        (MetaStep(K.RECV_F, 1, 0, 0),),
        (MetaStep(K.SEND_F, 1, 0, 0),),
    )
    assert expected_p2p([MetaStep(K.BWD_INPUT, 3, 1)], config) == (
        (),
        (MetaStep(K.SEND_B, 3, 1, 0),),
    )
    assert expected_p2p([MetaStep(K.BWD_WEIGHT, 1, 0)], config) == ((), ())


@pytest.mark.parametrize("config", LOWERED, ids=str)
def test_every_send_has_the_key_of_one_receive(config: ScheduleConfig) -> None:
    orders = build_all_orders(config)
    sent, received = [], []
    for rank, order in enumerate(orders):
        for step in p2p_leaves(order):
            partner = p2p_partner_stage(step)
            assert step.peer == config.rank_of(partner)
            key = message_key(rank, step)
            (sent if step.kind in (K.SEND_F, K.SEND_B) else received).append(key)
    assert sorted(sent) == sorted(received)
    assert len(set(sent)) == len(sent)


def test_pairing_helpers_refuse_other_steps() -> None:
    with pytest.raises(ValueError, match="not a P2P step"):
        p2p_partner_stage(MetaStep(K.FWD, 0, 0))
    with pytest.raises(ValueError, match="has no peer"):
        message_key(0, MetaStep(K.FWD, 0, 0))


def test_check_orders() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=1)
    assert check_orders(config, ((), ())) is config
    with pytest.raises(ValueError, match=r"one order per rank \(pp=2\), got 1"):
        check_orders(config, ((),))
    with pytest.raises(TypeError, match="config must be a ScheduleConfig"):
        check_orders("gpipe", ((), ()))


def test_the_interpreters_share_one_definition_of_a_compute_slot() -> None:
    assert swap_plan.compute_slots is compute_slots
    assert simulate.compute_slots is compute_slots


# -- validation does not trust lowering --------------------------------------------------------
def test_a_send_to_the_wrong_rank_is_refused() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=3, micro=4)
    order = build_exec_order(config, 1)
    send = MetaStep(K.SEND_F, 1, 2, 2)
    index = order.index(send)
    corrupted = (*order[:index], MetaStep(K.SEND_F, 1, 2, 0), *order[index + 1 :])
    with pytest.raises(ScheduleValidationError, match=r"missing SF2\.1; unexpected SF2\.1"):
        validate_order(config, 1, corrupted)


def test_validation_refuses_peers_that_lowerings_own_helper_agrees_with(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lowering bug in ``p2p_for_slot`` (every send of a composite one rank off) gives
    orders that agree with that helper; validation derives the peers from the placement
    and refuses them."""
    config = ScheduleConfig(schedule="1f1b", pp=3, micro=4, overlap_b_f=True)
    right = lowering.p2p_for_slot

    def off_by_one(
        slot: MetaStep, cfg: ScheduleConfig
    ) -> tuple[tuple[MetaStep, ...], tuple[MetaStep, ...]]:
        recvs, sends = right(slot, cfg)
        wrong = tuple(MetaStep(s.kind, s.stage, s.micro, ((s.peer or 0) + 1) % 3) for s in sends)
        return recvs, wrong

    monkeypatch.setattr(lowering, "p2p_for_slot", off_by_one)
    orders = lowering.build_all_orders(config)
    composites = 0
    for order in orders:
        for index, step in enumerate(order):
            if step.kind is K.OVERLAP_B_F:  # the order is what the buggy helper says
                composites += 1
                _, sends = lowering.p2p_for_slot(step, config)
                assert order[index + 1 : index + 1 + len(sends)] == sends
    assert composites
    with pytest.raises(ScheduleValidationError, match="do not match the data dependencies"):
        validate_all(config, orders)
