"""Reading orders: the facts every interpreter of the order IR shares, written once.

Validation (``validate``), the logical timeline and memory model (``simulate``) and the
cost model's step simulation (``cost_model``) all read orders the same way. This module is
that reading; none of them restates it.

Compute slots (``compute_slots``)
    A top-level compute leaf (FWD, BWD, BWD_INPUT, BWD_WEIGHT) is one compute slot; an
    OVERLAP_B_F / OVERLAP_F_B composite is ONE slot whose leaves are its compute sub-steps.
    Slots are numbered 0, 1, ... in order; P2P, FSDP and swap steps are not slots.
The dependency rule (``data_flow``: the only place it is written)
    Activations flow one stage up, gradients one stage down: the result of FWD(s, i) is
    read by stage ``s + 1``, the result of a backward consumer (BWD or BWD_INPUT) of
    ``(s, i)`` by stage ``s - 1``; BWD_WEIGHT's inputs are local. Hence
    (``leaf_dependency``):

    - FWD(s, i) needs FWD(s - 1, i); on stage 0 nothing;
    - BWD / BWD_INPUT(s, i) needs the backward consumer of ``(s + 1, i)``; on the last
      stage its own FWD(s, i) (the loss);
    - BWD_WEIGHT(s, i) needs BWD_INPUT(s, i).

    ``slot_dependencies`` lifts the rule to compute slots across ranks (what the timeline
    and the step simulation wait for).
Transfers (``expected_p2p``)
    A dependency across stages is a transfer: the producing leaf's rank sends, the
    reading leaf's rank receives, each rank naming the other as ``peer`` from the
    placement (``ScheduleConfig.rank_of``). ``expected_p2p(leaves, config)`` gives the
    RECV_* and SEND_* steps a compute slot implies. Lowering emits them with its own code
    (its hot loop); validation checks lowering's output against this derivation, so a
    wrong peer in lowering cannot also pass validation.
P2P pairing (``p2p_partner_stage``, ``message_key``)
    SEND_F(s, i) pairs with RECV_F(s + 1, i), SEND_B(s, i) with RECV_B(s - 1, i) (the
    conventions of ``steps.py``).
Order checks (``check_orders``)
    A set of orders holds one order per rank.

Every function is pure and imports no tensor framework.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import (
    BWD,
    BWD_INPUT,
    BWD_WEIGHT,
    COMPOSITE_KINDS,
    COMPUTE_KINDS,
    CONSUMER_KINDS,
    FWD,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    MetaStep,
    Order,
    StepKind,
    iter_leaves,
)

__all__ = [
    "ComputeSlot",
    "LeafKey",
    "MessageKey",
    "SlotRef",
    "check_order",
    "check_orders",
    "compute_slots",
    "consumer_kinds",
    "data_flow",
    "expected_p2p",
    "leaf_dependency",
    "message_key",
    "p2p_partner_stage",
    "slot_dependencies",
]

LeafKey = tuple[StepKind, int, int]
"""A compute leaf by value: ``(kind, stage, micro)``."""

SlotRef = tuple[int, int]
"""A compute slot of a set of orders: ``(rank, slot number)``."""

MessageKey = tuple[int, int, str, int, int]
"""A P2P message: ``(sender rank, receiver rank, "F" | "B", receiving stage, micro)``."""

_STEP_TYPE = frozenset({MetaStep})


# -- orders ----------------------------------------------------------------------------------
def check_order(order: object, name: str = "order") -> Order:
    """``order`` itself when it is a tuple of MetaStep; TypeError otherwise."""
    if not isinstance(order, tuple) or (
        not set(map(type, order)) <= _STEP_TYPE  # the fast test; subclasses take the slow one
        and not all(isinstance(step, MetaStep) for step in order)
    ):
        raise TypeError(f"{name} must be a tuple of MetaStep, got {type(order).__name__}")
    return order


def check_orders(config: object, orders: Sequence[Order]) -> ScheduleConfig:
    """``config`` when it is a ScheduleConfig and ``orders`` holds one order per rank.

    TypeError for a config of another type, ValueError for the wrong number of orders.
    """
    if not isinstance(config, ScheduleConfig):
        raise TypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    if len(orders) != config.pp:
        raise ValueError(f"orders must hold one order per rank (pp={config.pp}), got {len(orders)}")
    return config


# -- compute slots ---------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ComputeSlot:
    """One compute slot of an order: a top-level compute leaf or a composite.

    ``slot`` numbers the compute slots 0, 1, ...; ``index`` is the step's top-level index in
    the order; ``leaves`` are the compute leaves it runs (one, or two for a composite).
    """

    slot: int
    index: int
    step: MetaStep
    leaves: tuple[MetaStep, ...]


def compute_slots(order: Order) -> tuple[ComputeSlot, ...]:
    """Every compute slot of ``order`` with its compute leaves, in order (module docstring)."""
    check_order(order)
    slots: list[ComputeSlot] = []
    for index, step in enumerate(order):
        if step.kind in COMPUTE_KINDS:
            leaves: tuple[MetaStep, ...] = (step,)
        elif step.kind in COMPOSITE_KINDS:
            leaves = tuple(leaf for leaf in iter_leaves((step,)) if leaf.kind in COMPUTE_KINDS)
        else:
            continue
        slots.append(ComputeSlot(slot=len(slots), index=index, step=step, leaves=leaves))
    return tuple(slots)


# -- the dependency rule ---------------------------------------------------------------------
def data_flow(kind: StepKind) -> int:
    """Where a compute leaf's result goes: +1 (FWD: to stage + 1), -1 (BWD, BWD_INPUT: to
    stage - 1) or 0 (BWD_WEIGHT, and any non-compute kind: nowhere)."""
    if kind is FWD:
        return 1
    if kind is BWD or kind is BWD_INPUT:
        return -1
    return 0


def consumer_kinds(leaves: Iterable[MetaStep]) -> dict[tuple[int, int], StepKind]:
    """Chunk ``(stage, micro)`` -> the kind of its backward consumer (BWD or BWD_INPUT)."""
    return {leaf.chunk: leaf.kind for leaf in leaves if leaf.kind in CONSUMER_KINDS}


def leaf_dependency(
    kind: StepKind,
    stage: int,
    micro: int,
    num_stages: int,
    consumer_kind: Mapping[tuple[int, int], StepKind],
) -> LeafKey | None:
    """The leaf that must finish before leaf ``(kind, stage, micro)`` can start, or None.

    ``consumer_kind`` names the backward consumer of each chunk (``consumer_kinds``); a
    chunk missing from it is taken to have a BWD.
    """
    flow = data_flow(kind)
    if flow:
        source = stage - flow
        if 0 <= source < num_stages:
            upstream = FWD if flow > 0 else consumer_kind.get((source, micro), BWD)
            return (upstream, source, micro)
        return (FWD, stage, micro) if flow < 0 else None
    if kind is BWD_WEIGHT:
        return (BWD_INPUT, stage, micro)
    return None


def slot_dependencies(
    config: ScheduleConfig, slots: Sequence[Sequence[ComputeSlot]]
) -> tuple[tuple[tuple[SlotRef, ...], ...], ...]:
    """Per rank and compute slot, the slots ``(rank, slot)`` it waits for, in leaf order.

    ``slots[r]`` are rank ``r``'s compute slots (``compute_slots``). Raises ValueError
    when a leaf depends on a leaf no rank runs.
    """
    owner: dict[LeafKey, SlotRef] = {}
    for rank, rank_slots in enumerate(slots):
        for slot in rank_slots:
            for leaf in slot.leaves:
                owner[(leaf.kind, leaf.stage, leaf.micro)] = (rank, slot.slot)
    consumer_kind = consumer_kinds(
        leaf for rank_slots in slots for slot in rank_slots for leaf in slot.leaves
    )
    num_stages = config.num_stages
    out: list[tuple[tuple[SlotRef, ...], ...]] = []
    for rank, rank_slots in enumerate(slots):
        rank_deps: list[tuple[SlotRef, ...]] = []
        for slot in rank_slots:
            needed: list[SlotRef] = []
            for leaf in slot.leaves:
                dep = leaf_dependency(leaf.kind, leaf.stage, leaf.micro, num_stages, consumer_kind)
                if dep is None:
                    continue
                ref = owner.get(dep)
                if ref is None:
                    raise ValueError(
                        f"{slot.step.short()} of rank {rank} depends on {dep[0].value}"
                        f"(stage={dep[1]}, micro={dep[2]}), which no rank runs"
                    )
                needed.append(ref)
            rank_deps.append(tuple(needed))
        out.append(tuple(rank_deps))
    return tuple(out)


# -- transfers and their P2P steps -----------------------------------------------------------
def expected_p2p(
    leaves: Iterable[MetaStep], config: ScheduleConfig
) -> tuple[tuple[MetaStep, ...], tuple[MetaStep, ...]]:
    """``(recvs, sends)`` the compute ``leaves`` of one slot imply, in leaf order.

    Derived from ``data_flow`` and the placement ``config.rank_of`` (module docstring):
    a leaf receives from the stage its input comes from and sends to the stage that reads
    its result, when that stage exists; the peer is the rank holding that stage.
    """
    num_stages = config.num_stages
    recvs: list[MetaStep] = []
    sends: list[MetaStep] = []
    for leaf in leaves:
        flow = data_flow(leaf.kind)
        if not flow:
            continue
        recv_kind, send_kind = (RECV_F, SEND_F) if flow > 0 else (RECV_B, SEND_B)
        source, target = leaf.stage - flow, leaf.stage + flow
        if 0 <= source < num_stages:
            recvs.append(MetaStep(recv_kind, leaf.stage, leaf.micro, config.rank_of(source)))
        if 0 <= target < num_stages:
            sends.append(MetaStep(send_kind, leaf.stage, leaf.micro, config.rank_of(target)))
    return tuple(recvs), tuple(sends)


def p2p_partner_stage(step: MetaStep) -> int:
    """The stage at the other end of a P2P step: ``stage + 1`` for SEND_F and RECV_B,
    ``stage - 1`` for SEND_B and RECV_F. ValueError for a step that is not P2P."""
    kind = step.kind
    if kind is SEND_F or kind is RECV_B:
        return step.stage + 1
    if kind is SEND_B or kind is RECV_F:
        return step.stage - 1
    raise ValueError(f"{step.short()} is not a P2P step")


def message_key(rank: int, step: MetaStep) -> MessageKey:
    """The key a SEND on rank ``rank`` shares with its RECV on the peer (and the other way
    round). ValueError for a step that is not P2P or has no peer."""
    peer = step.peer
    if peer is None:
        raise ValueError(f"{step.short()} has no peer")
    kind = step.kind
    if kind is SEND_F or kind is SEND_B:
        direction = "F" if kind is SEND_F else "B"
        return (rank, peer, direction, p2p_partner_stage(step), step.micro)
    if kind is RECV_F or kind is RECV_B:
        return (peer, rank, "F" if kind is RECV_F else "B", step.stage, step.micro)
    raise ValueError(f"{step.short()} is not a P2P step")
