"""The swap planner: the last lowering pass, injecting four swap MetaSteps per chunk.

This follows RFC section 6.4 (planner), 6.3 (the four steps) and 6.6 (FSDP, P2P, dx/dw).
It works on one rank's *finalized* order (compute -> FSDP -> P2P transport), so it sees
the final FSDP lookahead and the final P2P containers. It is a pure function: the input
order is never changed, and removing the swap steps gives it back exactly.

Leaves and compute slots (RFC 6.4.1)
    FWD, BWD, BWD_INPUT and BWD_WEIGHT are compute leaves. A top-level compute leaf is one
    compute slot; an OVERLAP_B_F / OVERLAP_F_B composite is expanded to pair its leaves but
    counts as ONE compute slot (two concurrent leaves do not hide a window). Slots are
    numbered 0, 1, 2 ... in order; communication steps (P2P, BATCH_SEND_RECV, FSDP) are not
    slots (``analysis.compute_slots``; re-exported here).

Pairing and eligibility (RFC 6.4.2)
    Each FWD(s, i) is paired with its activation consumer: BWD(s, i), or BWD_INPUT(s, i)
    with the dx/dw split. BWD_WEIGHT never loads or releases anything.
    ``gap = consumer_slot - fwd_slot``; the chunk is eligible iff
    ``gap >= config.min_swap_gap`` (default 4, validated >= 2 by ScheduleConfig). gap 1
    leaves no load window, gap 2 frees storage only to re-allocate it at once, gap 3 has
    a single edge window; from 4 on the whole D2H/H2D life cycle is injected.

Placement (RFC 6.4.3 and 6.6). Let ``t(k)`` be the top-level index of compute slot ``k``,
``f`` the FWD's slot and ``c`` the consumer's slot. A step "at point p" is inserted
before the input step ``p``:

- SWAP_LAUNCH_OFFLOAD right after the FWD's top-level step (the leaf or its composite)
  and that slot's sends (SEND_* steps, or the BATCH_SEND_RECV container holding them),
  before its FSDP_RESHARD (``FWD -> sends -> SWAP_LAUNCH_OFFLOAD -> FSDP_RESHARD``). The
  RFC's anchor is "after the FWD's container, before FSDP_RESHARD"; the sends go first
  because launching an offload runs a prepare job on the compute thread, and with ranks
  sharing one compute thread that job can wait behind another rank's leaf: a send placed
  after it reached the next stage up to a leaf late (measured: 33 ms in a 1F1B trace).
  A send only posts (it never waits for delivery), and a batch container only posts its
  receives, so nothing moves the launch later than the slot's own sends.
- SWAP_WAIT_OFFLOAD: after the first intervening compute slot ``f + 1`` and the
  contiguous communication block that follows it (sends, FSDP actions, BATCH_SEND_RECV
  containers, the next slot's recvs), i.e. at ``t(f + 2)`` just before the next compute
  slot, but ahead of any SWAP_LAUNCH_LOAD placed in that same block: at the earliest
  LAUNCH_LOAD point of the block when there is one (release device storage before the
  block allocates it again, so the block never holds both).
- SWAP_LAUNCH_LOAD:
    * FSDP on the consumer's stage (the order holds FSDP steps for that stage) and the
      consumer starts a use run of that stage (the last FSDP step of the stage before the
      consumer is an FSDP_UNSHARD and no compute slot uses the stage in between): at that
      UNSHARD's index, i.e. ``SWAP_LAUNCH_LOAD -> FSDP_UNSHARD -> ... -> SWAP_WAIT_LOAD ->
      BWD``, so the H2D copy overlaps the all-gather (the same UNSHARD that
      ``lowering.unshard_index_for`` returns; a property test checks they agree);
    * FSDP on, but the stage is already unsharded when the consumer runs (no lookahead
      to cover): at ``t(c)``, right before SWAP_WAIT_LOAD ("delayed to avoid bringing the
      activation back too early");
    * no FSDP: at the last cover point, before the compute slot ``c - 1`` preceding the
      consumer and before that slot's receives: the start of the trailing run of
      receive-side steps (RECV_F, RECV_B, or a BATCH_SEND_RECV holding a receive) of the
      block between slots ``c - 2`` and ``c - 1``;
  and in every case never before this chunk's SWAP_WAIT_OFFLOAD: the point is
  ``max(anchor, t(f + 2))``. That clamp is what gives gap 2 and gap 3 their shape
  (gap 2: WAIT_OFFLOAD, LAUNCH_LOAD and WAIT_LOAD all right before the consumer; gap 3:
  the load is launched right before slot ``c - 1``).
- SWAP_WAIT_LOAD at ``t(c)``: immediately before the consumer's top-level step, after its
  recvs or BATCH_SEND_RECV container.

P2P modes: ``plain`` and ``boundary`` have the same positions (boundary differs only at
run time, where the FWD output handed to SEND_F is an alias the session protects);
``batch`` containers are never split, so an anchor before or after a receive lands
before or after the whole container.

Swap steps are only ever inserted between top-level steps: never inside a BATCH_SEND_RECV
or a composite, and no other step moves. Several swap steps at the same point are ordered
by kind in life-cycle order (LAUNCH_OFFLOAD, WAIT_OFFLOAD, LAUNCH_LOAD, WAIT_LOAD), then by
chunk ``(stage, micro)``. For one chunk this always yields
``FWD < LAUNCH_OFFLOAD < WAIT_OFFLOAD < LAUNCH_LOAD < WAIT_LOAD < consumer``.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

from ppswap.scheduler.analysis import CONSUMER_KINDS, ComputeSlot, compute_slots
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import (
    COMPUTE_KINDS,
    FSDP_KINDS,
    MetaStep,
    Order,
    StepKind,
    iter_leaves,
)

__all__ = [
    "CONSUMER_KINDS",
    "SWAP_KIND_ORDER",
    "ComputeSlot",
    "SwapChunkPlan",
    "chunks_on_host_peak",
    "compute_slots",
    "eligible_chunks",
    "inject_swap_steps",
    "plan_swap",
    "select_chunks",
    "strip_swap_steps",
]

SWAP_KIND_ORDER: tuple[StepKind, ...] = (
    StepKind.SWAP_LAUNCH_OFFLOAD,
    StepKind.SWAP_WAIT_OFFLOAD,
    StepKind.SWAP_LAUNCH_LOAD,
    StepKind.SWAP_WAIT_LOAD,
)
"""Life-cycle order of the swap kinds; also the tie-break for steps at the same point."""

_KIND_RANK = {kind: rank for rank, kind in enumerate(SWAP_KIND_ORDER)}
_RECV_KINDS = frozenset({StepKind.RECV_F, StepKind.RECV_B})
_SEND_KINDS = frozenset({StepKind.SEND_F, StepKind.SEND_B})


@dataclass(frozen=True, slots=True)
class SwapChunkPlan:
    """The swap decision for one chunk ``(stage, micro)`` of a rank.

    ``fwd_slot`` and ``consumer_slot`` are compute-slot numbers (see ``compute_slots``),
    ``gap = consumer_slot - fwd_slot``, ``eligible`` iff ``gap >= min_swap_gap`` (or, with an
    explicit selection, iff selected: see ``select_chunks``).
    """

    stage: int
    micro: int
    fwd_slot: int
    consumer_slot: int
    gap: int
    eligible: bool

    @property
    def chunk(self) -> tuple[int, int]:
        return (self.stage, self.micro)


def _check_order(order: object, name: str = "order") -> Order:
    if not isinstance(order, tuple) or not all(isinstance(s, MetaStep) for s in order):
        raise TypeError(f"{name} must be a tuple of MetaStep, got {type(order).__name__}")
    return order


def _check_config(config: object) -> ScheduleConfig:
    if not isinstance(config, ScheduleConfig):
        raise TypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    return config


def plan_swap(order: Order, config: ScheduleConfig) -> tuple[SwapChunkPlan, ...]:
    """Pair each FWD with its consumer and decide eligibility, in FWD order.

    ``order`` is one rank's order without swap steps. Raises ValueError when a chunk has
    two FWDs or two consumers, a consumer without FWD, a FWD without consumer (a
    forward-only order has nothing to swap) or a consumer before its FWD.
    """
    _check_order(order)
    _check_config(config)
    if any(step.is_swap for step in order):
        raise ValueError(
            "order must not hold swap steps already (strip_swap_steps(order) first), "
            f"got {sum(step.is_swap for step in order)} swap steps"
        )
    fwd_slot: dict[tuple[int, int], int] = {}
    consumer_slot: dict[tuple[int, int], int] = {}
    for slot in compute_slots(order):
        for leaf in slot.leaves:
            if leaf.kind is StepKind.FWD:
                table = fwd_slot
            elif leaf.kind in CONSUMER_KINDS:
                table = consumer_slot
            else:
                continue
            if leaf.chunk in table:
                raise ValueError(
                    f"order holds two {leaf.kind.value} steps for chunk (stage, micro) = "
                    f"{leaf.chunk}; each chunk needs exactly one"
                )
            table[leaf.chunk] = slot.slot
    for chunk in consumer_slot:
        if chunk not in fwd_slot:
            raise ValueError(f"chunk (stage, micro) = {chunk} has a backward but no FWD")
    plans: list[SwapChunkPlan] = []
    for chunk, f in sorted(fwd_slot.items(), key=lambda item: (item[1], item[0])):
        if chunk not in consumer_slot:
            raise ValueError(
                f"chunk (stage, micro) = {chunk} has a FWD but no BWD/BWD_INPUT consumer; "
                "swap needs a backward for every forward"
            )
        gap = consumer_slot[chunk] - f
        if gap < 0:
            raise ValueError(
                f"chunk (stage, micro) = {chunk}: its consumer (slot {consumer_slot[chunk]}) "
                f"comes before its FWD (slot {f})"
            )
        plans.append(
            SwapChunkPlan(
                stage=chunk[0],
                micro=chunk[1],
                fwd_slot=f,
                consumer_slot=consumer_slot[chunk],
                gap=gap,
                eligible=gap >= config.min_swap_gap,
            )
        )
    return tuple(plans)


def _posts(step: MetaStep, kinds: frozenset[StepKind]) -> bool:
    """Whether ``step`` is a P2P step of ``kinds`` or a BATCH_SEND_RECV holding one."""
    if step.kind in kinds:
        return True
    return step.kind is StepKind.BATCH_SEND_RECV and any(
        leaf.kind in kinds for leaf in iter_leaves(step.sub_steps)
    )


def _uses_stage(step: MetaStep, stage: int) -> bool:
    return step.is_compute and any(
        leaf.kind in COMPUTE_KINDS and leaf.stage == stage for leaf in iter_leaves((step,))
    )


def _after_sends(order: Order, slot_index: int) -> int:
    """The point right after the compute slot at ``slot_index`` and its sends.

    A slot's sends follow it directly (the gap layout of ``lowering``), so every send
    step, or container holding one, right after the slot is one of its own.
    """
    point = slot_index + 1
    while point < len(order) and _posts(order[point], _SEND_KINDS):
        point += 1
    return point


def _launch_load_anchor(
    order: Order, slots: Sequence[ComputeSlot], plan: SwapChunkPlan, fsdp_stages: frozenset[int]
) -> int:
    """The point SWAP_LAUNCH_LOAD wants before the clamp to its WAIT_OFFLOAD."""
    consumer_index = slots[plan.consumer_slot].index
    if plan.stage in fsdp_stages:
        for index in range(consumer_index - 1, -1, -1):
            step = order[index]
            if _uses_stage(step, plan.stage):
                return consumer_index  # already unsharded for an earlier use: delay
            if step.kind in FSDP_KINDS and step.stage == plan.stage:
                if step.kind is StepKind.FSDP_UNSHARD:
                    return index  # the lookahead unshard of the run the consumer starts
                return consumer_index
        return consumer_index
    block_start = slots[plan.consumer_slot - 2].index + 1
    point = slots[plan.consumer_slot - 1].index
    while point > block_start and _posts(order[point - 1], _RECV_KINDS):
        point -= 1
    return point


def _swap_points(order: Order, plans: Sequence[SwapChunkPlan]) -> list[tuple[int, MetaStep]]:
    slots = compute_slots(order)
    fsdp_stages = frozenset(step.stage for step in order if step.kind in FSDP_KINDS)
    eligible = [plan for plan in plans if plan.eligible]
    launch_loads: list[int] = []
    for plan in eligible:
        anchor = _launch_load_anchor(order, slots, plan, fsdp_stages)
        launch_loads.append(max(anchor, slots[plan.fwd_slot + 2].index))
    # The earliest LAUNCH_LOAD point after the gap start, by bisection (a scan of every
    # chunk's point per chunk made this pass quadratic: 5 s per rank at micro=1024, vpp=4).
    sorted_loads = sorted(launch_loads)
    placed: list[tuple[int, MetaStep]] = []
    for plan, launch_load in zip(eligible, launch_loads, strict=True):
        gap_start = slots[plan.fwd_slot + 1].index
        wait_offload = slots[plan.fwd_slot + 2].index
        after = bisect_right(sorted_loads, gap_start)
        if after < len(sorted_loads):
            wait_offload = min(wait_offload, sorted_loads[after])
        points = (
            _after_sends(order, slots[plan.fwd_slot].index),
            wait_offload,
            launch_load,
            slots[plan.consumer_slot].index,
        )
        for kind, point in zip(SWAP_KIND_ORDER, points, strict=True):
            placed.append((point, MetaStep(kind, plan.stage, plan.micro)))
    placed.sort(key=lambda item: (item[0], _KIND_RANK[item[1].kind], item[1].chunk))
    return placed


def select_chunks(
    plans: Sequence[SwapChunkPlan],
    chunks: Collection[tuple[int, int]],
    rank_stages: Collection[int],
) -> tuple[SwapChunkPlan, ...]:
    """``plans`` with ``eligible`` replaced by an explicit selection ``chunks``.

    Used by policies other than the fixed gap rule (``ppswap.scheduler.cost``): a plan is
    selected iff its chunk is in ``chunks``. Chunks whose stage is not in ``rank_stages``
    (another rank's) are ignored, so one selection can serve every rank. A chunk of this
    rank that the order does not run, or whose gap is below 2 (no room for the four steps),
    raises ValueError. The placement of the selected chunks is the gap rule's.
    """
    if not isinstance(chunks, Collection) or isinstance(chunks, str | bytes):
        raise TypeError(f"chunks must be a collection of (stage, micro) pairs, got {chunks!r}")
    by_chunk = {plan.chunk: plan for plan in plans}
    wanted: set[tuple[int, int]] = set()
    for chunk in chunks:
        if not (
            isinstance(chunk, tuple)
            and len(chunk) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in chunk)
        ):
            raise TypeError(f"chunks must hold (stage, micro) int pairs, got {chunk!r}")
        if chunk[0] not in rank_stages:
            continue
        plan = by_chunk.get(chunk)
        if plan is None:
            raise ValueError(
                f"chunks holds (stage, micro) = {chunk}, which this order does not run"
            )
        if plan.gap < 2:
            raise ValueError(
                f"chunks holds (stage, micro) = {chunk} with gap {plan.gap}; a swapped chunk "
                "needs gap >= 2 (room for the four swap steps)"
            )
        wanted.add(chunk)
    return tuple(replace(plan, eligible=plan.chunk in wanted) for plan in plans)


def inject_swap_steps(
    order: Order,
    config: ScheduleConfig,
    rank: int,
    *,
    chunks: Collection[tuple[int, int]] | None = None,
) -> Order:
    """Last lowering pass: return ``order`` with the four swap steps of each eligible chunk.

    Identity when ``config.swap`` is False. ``rank`` must be in ``0 .. pp-1`` and every
    compute leaf of ``order`` must belong to a stage of that rank. The placement rules are
    in the module docstring; the input is never mutated and
    ``strip_swap_steps(result) == order``.

    ``chunks``: an explicit selection replacing the gap rule (``select_chunks``): exactly
    these chunks of this rank are swapped, placed by the same anchors. None (the default)
    is the fixed rule ``gap >= config.min_swap_gap``.
    """
    _check_order(order)
    _check_config(config)
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"rank must be an int in 0..{config.pp - 1}, got {rank!r}")
    if not 0 <= rank < config.pp:
        raise ValueError(f"rank must be an int in 0..{config.pp - 1}, got {rank!r}")
    if not config.swap:
        return order
    for slot in compute_slots(order):
        for leaf in slot.leaves:
            if config.rank_of(leaf.stage) != rank:
                raise ValueError(
                    f"order for rank {rank} holds {leaf.short()} of stage {leaf.stage}, "
                    f"which lives on rank {config.rank_of(leaf.stage)}"
                )
    plans = plan_swap(order, config)
    if chunks is not None:
        plans = select_chunks(plans, chunks, config.stages_of(rank))
    placed = _swap_points(order, plans)
    result: list[MetaStep] = []
    cursor = 0
    for index, step in enumerate(order):
        while cursor < len(placed) and placed[cursor][0] == index:
            result.append(placed[cursor][1])
            cursor += 1
        result.append(step)
    result.extend(step for _, step in placed[cursor:])
    return tuple(result)


def eligible_chunks(order: Order) -> frozenset[tuple[int, int]]:
    """The chunks ``(stage, micro)`` with a SWAP_LAUNCH_OFFLOAD in a finalized order.

    The runtime opens a swap group only for these (RFC 6.5); every other FWD runs without.
    """
    _check_order(order)
    return frozenset(step.chunk for step in order if step.kind is StepKind.SWAP_LAUNCH_OFFLOAD)


def chunks_on_host_peak(order: Order) -> int:
    """The most chunks of one rank whose host copies exist at once, from its final order.

    A chunk's host buffers are taken by its offload copy and given back when its load copy
    ends. The runtime runs a rank's copies one at a time in launch order (one FIFO copy
    stream), so when a chunk's offload runs, every load launched before it has ended: the
    chunks on host then are those offloaded and not yet loaded in launch order, whatever
    the timing. Times the bytes of a chunk, this sizes the rank's host memory.
    """
    _check_order(order)
    on_host = peak = 0
    for step in iter_leaves(order):
        if step.kind is StepKind.SWAP_LAUNCH_OFFLOAD:
            on_host += 1
            peak = max(peak, on_host)
        elif step.kind is StepKind.SWAP_LAUNCH_LOAD:
            on_host -= 1
    return peak


def strip_swap_steps(order: Order) -> Order:
    """``order`` without its swap steps: the inverse of ``inject_swap_steps``."""
    _check_order(order)
    return tuple(step for step in order if not step.is_swap)
