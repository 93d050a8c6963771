"""Lowering: a rank's compute order -> its finalized order of MetaSteps.

``build_exec_order(config, rank)`` =
``compute_order`` -> ``inject_fsdp_steps`` (when ``config.fsdp``) -> ``rewrite_p2p`` ->
``swap_plan.inject_swap_steps`` (when ``config.swap``; last, so that it sees the final
FSDP steps and P2P containers). Every pass is a pure function ``(order, config, rank) ->
order``: it builds a new tuple, never mutates its input, and depends on nothing but its
arguments.

Gap layout. A *compute slot* is a top-level compute leaf or a composite. Between two
consecutive compute slots ``P`` and ``X`` (the *gap*), steps always come in this order::

    P, sends of P, FSDP_RESHARDs (runs ending at P), FSDP_UNSHARDs, recvs of X, X

Swap steps (the last pass) are inserted between these by the swap planner.

FSDP (``inject_fsdp_steps``; per stage of this rank, ``micro == -1``)
    A *use run* of stage ``s`` is a maximal sequence of consecutive compute slots that use
    ``s`` (any leaf, BWD_WEIGHT included, has stage ``s``), additionally split at the
    stage's first backward slot (BWD or BWD_INPUT): so GPipe has one forward run and one
    backward run per stage, and 1F1B re-gathers the parameters for its backward phase.
    FSDP_RESHARD(s) comes right after the last slot of each run. FSDP_UNSHARD(s) opens
    each run with a one-step lookahead: it is placed before the compute slot that
    precedes the run, unless that slot uses ``s`` itself (the previous run of ``s``, cut
    at the first backward) or the run starts at slot 0; then it sits right before the
    run. An UNSHARD therefore never precedes the same stage's previous RESHARD. Several
    RESHARDs in one gap are ordered by stage; several UNSHARDs by the slot of the run
    they open, then by stage. For the swap planner: the UNSHARD that serves a consumer
    which opens a use run is the last FSDP step of that stage before the consumer, and
    ``unshard_index_for(order, consumer_index)`` returns its index.

P2P (``rewrite_p2p``)
    Every data dependency across stages gets a SEND/RECV pair (``stage`` is the local
    stage, ``peer`` the remote rank, see ``steps.py``):

    - FWD(s, i), s > 0: RECV_F(s, i, peer=rank(s - 1)) before it;
    - FWD(s, i), s < last: SEND_F(s, i, peer=rank(s + 1)) after it;
    - BWD / BWD_INPUT(s, i), s < last: RECV_B(s, i, peer=rank(s + 1)) before it;
    - BWD / BWD_INPUT(s, i), s > 0: SEND_B(s, i, peer=rank(s - 1)) after it;
    - BWD_WEIGHT: nothing (its inputs are local). Forward-only runs have no B steps.

    Placement: a RECV sits directly before its consumer (after the gap's sends and FSDP
    steps); the consumer's RECV is the point where the data must have arrived (the
    runtime may post the irecv earlier; the consumer awaits it). Sends come right after
    their producer. For a composite, the recvs of both leaves go before it and the sends
    of both after it, in sub-step order. The peer is the rank ``config.rank_of`` places the
    other stage on (V placement for zbv and dualpipev). A handoff between two stages on
    the same rank (``pp == 1`` interleaved: every stage is on rank 0; the V's turn, stages
    ``pp - 1`` and ``pp`` on the last rank) still gets a SEND/RECV pair with ``peer ==
    rank``: the runtime delivers it locally, and keeping the pair keeps one rule for every
    dependency (validation, the deadlock proof and the swap planner need no special case).

    Modes: ``plain`` emits one step per send/recv. ``batch`` fuses every maximal run of
    two or more consecutive P2P steps into one BATCH_SEND_RECV (posted together, like
    Megatron's fused send/recv pairs); a lone P2P step stays bare, since a batch of one is
    that step (this also keeps the order short: at pp=32 most gaps hold a lone step).
    FSDP steps sit between runs, never inside, so a gap with FSDP steps has its sends and
    its recvs in separate runs. ``boundary`` has exactly the positions of ``plain``: the
    difference is in the runtime, which hands the FWD output tensor itself to SEND_F
    without a copy. That tensor is then an alias the swap planner and session must
    protect: it may be the saved activation of the FWD, and offloading it would free
    storage the send still reads.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.schedules import check_rank, compute_order
from ppswap.scheduler.steps import (
    BATCH_SEND_RECV,
    BWD,
    BWD_INPUT,
    COMPOSITE_KINDS,
    COMPUTE_KINDS,
    FSDP_RESHARD,
    FSDP_UNSHARD,
    FWD,
    OVERLAP_B_F,
    OVERLAP_F_B,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    MetaStep,
    Order,
    trusted_step,
)
from ppswap.scheduler.swap_plan import inject_swap_steps

__all__ = [
    "build_all_orders",
    "build_exec_order",
    "inject_fsdp_steps",
    "p2p_for_slot",
    "rewrite_p2p",
    "unshard_index_for",
]


def _leaves_of(slot: MetaStep) -> tuple[MetaStep, ...]:
    return slot.sub_steps if slot.sub_steps else (slot,)


_COMPUTE_SLOT_VALUES = frozenset(kind.value for kind in COMPUTE_KINDS | COMPOSITE_KINDS)


def _require_compute_only(order: Order, pass_name: str) -> None:
    slot_values = _COMPUTE_SLOT_VALUES
    for index, step in enumerate(order):
        # by value: a str hash is cached, the Enum's __hash__ is a Python call (hot loop)
        if step.kind._value_ not in slot_values:
            raise ValueError(
                f"{pass_name} takes a compute order (compute leaves and composites only), "
                f"got {step.kind.value} at index {index}"
            )


# -- FSDP ------------------------------------------------------------------------------------
def inject_fsdp_steps(order: Order, config: ScheduleConfig, rank: int) -> Order:
    """Add FSDP_UNSHARD / FSDP_RESHARD steps to a compute order (module docstring).

    Identity when ``config.fsdp`` is False. ``order`` must hold compute slots only.
    """
    check_rank(config, rank)
    _require_compute_only(order, "inject_fsdp_steps")
    if not config.fsdp:
        return order
    # Pass 1: the use runs of each stage, hence where each UNSHARD and RESHARD goes. A run
    # of ``stage`` opens at ``index`` unless the stage's previous use is the slot just
    # before (and ``index`` is not the stage's first backward). Its UNSHARD goes before
    # slot ``index - 1`` (the lookahead) unless that slot is the stage's previous use.
    unshard_at: dict[int, list[tuple[int, int]]] = {}
    reshard_at: dict[int, list[int]] = {}
    last_use: dict[int, int] = {}
    backward_seen: set[int] = set()
    single: list[MetaStep] = list(order[:1])  # reused holder: no tuple per plain slot
    leaves: Sequence[MetaStep]
    for index, slot in enumerate(order):
        if slot.sub_steps:
            leaves = slot.sub_steps
        else:
            single[0] = slot
            leaves = single
        for leaf in leaves:
            stage = leaf.stage
            kind = leaf.kind
            opens_backward = False
            if (kind is BWD or kind is BWD_INPUT) and stage not in backward_seen:
                backward_seen.add(stage)
                opens_backward = True
            previous = last_use.get(stage)
            if previous == index:  # the composite's other leaf is on the same stage
                continue
            last_use[stage] = index
            if previous == index - 1 and not opens_backward:
                continue
            if previous is not None:
                reshard_at.setdefault(previous, []).append(stage)
            host = index - 1 if index > 0 and previous != index - 1 else index
            unshard_at.setdefault(host, []).append((index, stage))
    for stage, end in last_use.items():
        reshard_at.setdefault(end, []).append(stage)

    # Pass 2: emit. RESHARDs by stage; UNSHARDs by the slot of the run they open, then stage.
    unshard = {stage: MetaStep(FSDP_UNSHARD, stage, -1) for stage in last_use}
    reshard = {stage: MetaStep(FSDP_RESHARD, stage, -1) for stage in last_use}
    out: list[MetaStep] = []
    for index, slot in enumerate(order):
        opening = unshard_at.get(index)
        if opening is not None:
            opening.sort()
            for _, stage in opening:
                out.append(unshard[stage])
        out.append(slot)
        closing = reshard_at.get(index)
        if closing is not None:
            closing.sort()
            for stage in closing:
                out.append(reshard[stage])
    return tuple(out)


def unshard_index_for(order: Order, consumer_index: int, stage: int | None = None) -> int | None:
    """Index of the FSDP_UNSHARD that opens the use run ``order[consumer_index]`` belongs to.

    ``order[consumer_index]`` must be a compute slot; ``stage`` defaults to the stage of
    its (first) leaf, which is the backward leaf of an OVERLAP_B_F. Returns None when the
    stage's parameters are already unsharded for the consumer (it continues a use run)
    or the order has no FSDP step for that stage. The UNSHARD found may lie before the
    compute slot preceding the consumer (the lookahead) or in the consumer's own gap.
    """
    if not 0 <= consumer_index < len(order):
        raise ValueError(f"consumer_index must be in 0..{len(order) - 1}, got {consumer_index!r}")
    consumer = order[consumer_index]
    if consumer.kind not in COMPUTE_KINDS and consumer.kind not in COMPOSITE_KINDS:
        raise ValueError(
            f"consumer_index must point at a compute slot, got {consumer.kind.value} "
            f"at index {consumer_index}"
        )
    wanted = _leaves_of(consumer)[0].stage if stage is None else stage
    for index in range(consumer_index - 1, -1, -1):
        step = order[index]
        kind = step.kind
        if kind in COMPOSITE_KINDS:
            if any(leaf.stage == wanted for leaf in step.sub_steps):
                return None
            continue
        if step.stage != wanted:
            continue
        if kind is FSDP_UNSHARD:
            return index
        if kind is FSDP_RESHARD or kind in COMPUTE_KINDS:
            return None
    return None


# -- P2P -------------------------------------------------------------------------------------
def p2p_for_slot(
    slot: MetaStep, config: ScheduleConfig
) -> tuple[tuple[MetaStep, ...], tuple[MetaStep, ...]]:
    """``(recvs, sends)`` a compute slot needs, in sub-step order (module docstring)."""
    rank_of = config.rank_of
    last = config.num_stages - 1
    recvs: list[MetaStep] = []
    sends: list[MetaStep] = []
    for leaf in _leaves_of(slot):
        kind, stage, micro = leaf.kind, leaf.stage, leaf.micro
        if kind is FWD:
            if stage > 0:
                recvs.append(MetaStep(RECV_F, stage, micro, rank_of(stage - 1)))
            if stage < last:
                sends.append(MetaStep(SEND_F, stage, micro, rank_of(stage + 1)))
        elif kind is BWD or kind is BWD_INPUT:
            if stage < last:
                recvs.append(MetaStep(RECV_B, stage, micro, rank_of(stage + 1)))
            if stage > 0:
                sends.append(MetaStep(SEND_B, stage, micro, rank_of(stage - 1)))
    return tuple(recvs), tuple(sends)


def rewrite_p2p(order: Order, config: ScheduleConfig, rank: int) -> Order:
    """Add the P2P transport steps of every cross-stage dependency (module docstring).

    ``order`` may hold compute slots and FSDP steps, but no P2P steps or containers yet.
    """
    check_rank(config, rank)
    placement = config.placement()
    last = config.num_stages - 1
    batch = config.p2p == "batch"
    step_of = trusted_step
    # One pass, hot at scale: kinds compared by identity, the steps of a single leaf built
    # inline. P2P steps collect in ``run`` until the next non-P2P step, then go out fused
    # into one BATCH_SEND_RECV (batch mode, two or more steps) or as they are.
    out: list[MetaStep] = []
    append = out.append
    extend = out.extend
    run: list[MetaStep] = []
    for index, step in enumerate(order):
        kind = step.kind
        send: MetaStep | None = None
        more_sends: tuple[MetaStep, ...] = ()
        if kind is FWD:
            stage = step.stage
            if stage > 0:
                run.append(step_of(RECV_F, stage, step.micro, placement[stage - 1]))
            if stage < last:
                send = step_of(SEND_F, stage, step.micro, placement[stage + 1])
        elif kind is BWD or kind is BWD_INPUT:
            stage = step.stage
            if stage < last:
                run.append(step_of(RECV_B, stage, step.micro, placement[stage + 1]))
            if stage > 0:
                send = step_of(SEND_B, stage, step.micro, placement[stage - 1])
        elif kind is OVERLAP_B_F or kind is OVERLAP_F_B:
            recvs, more_sends = p2p_for_slot(step, config)
            run.extend(recvs)
        elif (
            kind is SEND_F or kind is RECV_F or kind is SEND_B or kind is RECV_B
        ) or kind is BATCH_SEND_RECV:
            raise ValueError(
                f"rewrite_p2p takes an order without P2P steps, got {kind.value} at index {index}"
            )
        if run:
            if batch and len(run) > 1:
                append(step_of(BATCH_SEND_RECV, run[0].stage, run[0].micro, None, tuple(run)))
            else:
                extend(run)
            run.clear()
        append(step)
        if send is not None:
            run.append(send)
        elif more_sends:
            run.extend(more_sends)
    if run:
        if batch and len(run) > 1:
            append(step_of(BATCH_SEND_RECV, run[0].stage, run[0].micro, None, tuple(run)))
        else:
            extend(run)
    return tuple(out)


# -- the pipeline ----------------------------------------------------------------------------
def build_exec_order(config: ScheduleConfig, rank: int) -> Order:
    """The finalized order of one rank: compute -> FSDP -> P2P -> swap (module docstring)."""
    check_rank(config, rank)
    order = compute_order(config, rank)
    if config.fsdp:
        order = inject_fsdp_steps(order, config, rank)
    order = rewrite_p2p(order, config, rank)
    if config.swap:
        order = inject_swap_steps(order, config, rank)
    return order


def build_all_orders(config: ScheduleConfig) -> tuple[Order, ...]:
    """``build_exec_order`` for every rank, indexed by rank (the collector paused)."""
    with collector_paused():
        return tuple(build_exec_order(config, rank) for rank in range(config.pp))


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector's automatic runs inside the block, then restore
    its previous state. Lowering builds hundreds of thousands of MetaSteps (about 300k
    for interleaved pp32 vpp4 m256), immutable and free of cycles, and every collection
    their allocations trigger rescans them all: 35-45% of that lowering's time, measured.
    Nothing is lost by skipping those collections; the next automatic one runs as usual.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
