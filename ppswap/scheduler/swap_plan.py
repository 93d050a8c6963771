"""The swap planner: the last lowering pass, injecting four swap MetaSteps per chunk.

It chooses the chunks (the gap rule), places each chunk's four swap steps (offload launch
and wait, load launch and wait) and orders them with FSDP, P2P and the dx/dw split. It
works on one rank's *finalized* order (compute -> FSDP -> P2P transport), so it sees the
final FSDP lookahead and the final P2P containers. It is a pure function: the input
order is never changed, and removing the swap steps gives it back exactly.

Leaves and compute slots
    FWD, BWD, BWD_INPUT and BWD_WEIGHT are compute leaves. A top-level compute leaf is one
    compute slot; an OVERLAP_B_F / OVERLAP_F_B composite is expanded to pair its leaves but
    counts as ONE compute slot (two concurrent leaves do not hide a window). Slots are
    numbered 0, 1, 2 ... in order; communication steps (P2P, BATCH_SEND_RECV, FSDP) are not
    slots (``analysis.compute_slots``; re-exported here).

Pairing and eligibility
    Each FWD(s, i) is paired with its activation consumer: BWD(s, i), or BWD_INPUT(s, i)
    with the dx/dw split. BWD_WEIGHT never loads or releases anything.
    ``gap = consumer_slot - fwd_slot``; the chunk is eligible iff
    ``gap >= config.min_swap_gap`` (default 4, validated >= 2 by ScheduleConfig). gap 1
    leaves no load window, gap 2 frees storage only to re-allocate it at once, gap 3 has
    a single edge window; from 4 on the whole D2H/H2D life cycle is injected.

Placement. Let ``t(k)`` be the top-level index of compute slot ``k``,
``f`` the FWD's slot and ``c`` the consumer's slot. A step "at point p" is inserted
before the input step ``p``:

- SWAP_LAUNCH_OFFLOAD right after the FWD's top-level step (the leaf or its composite)
  and that slot's sends (SEND_* steps, or the BATCH_SEND_RECV container holding them),
  before its FSDP_RESHARD (``FWD -> sends -> SWAP_LAUNCH_OFFLOAD -> FSDP_RESHARD``). The
  anchor is after the FWD's container and before FSDP_RESHARD; the sends go first
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

Cost: linear in the order. One scan pairs the chunks and notes, per stage, whether the
stage's last FSDP event before each consumer is its UNSHARD; the anchors then look only
at the few steps around each chunk's slots, and the swap steps are merged in by point.
On one rank of interleaved 1F1B pp=32 vpp=4 m=256 with FSDP and batch P2P (7799 steps,
1024 chunks) the pass takes about 5.6 ms, 1.4 us per swap step, of which a third is
building the four MetaSteps (``benchmarks/bench_plan.py`` times the whole lowering).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ppswap.scheduler.analysis import ComputeSlot, check_order, compute_slots
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import (
    BATCH_SEND_RECV,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    SWAP_LAUNCH_LOAD,
    SWAP_LAUNCH_OFFLOAD,
    SWAP_WAIT_LOAD,
    SWAP_WAIT_OFFLOAD,
    MetaStep,
    Order,
    StepKind,
    iter_leaves,
    trusted_step,
)
from ppswap.scheduler.swap_pairing import Chunk, SwapPairing, pair_chunks

__all__ = [
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
    check_order(order)
    config = _check_config(config)
    pairing = pair_chunks(order, config, None)
    min_gap = config.min_swap_gap
    return tuple(
        SwapChunkPlan(stage, micro, f, c, c - f, c - f >= min_gap)
        for (stage, micro), f, c in zip(
            pairing.chunks, pairing.fwd_slot, pairing.consumer_slot, strict=True
        )
    )


def _holds(steps: Sequence[MetaStep], first: StepKind, second: StepKind) -> bool:
    """Whether a leaf of ``steps`` (containers expanded) is of kind ``first`` or ``second``."""
    for leaf in steps:
        if leaf.sub_steps:
            if _holds(leaf.sub_steps, first, second):
                return True
        elif leaf.kind is first or leaf.kind is second:
            return True
    return False


def _posts_send(step: MetaStep) -> bool:
    """A SEND_* step, or a BATCH_SEND_RECV holding one."""
    kind = step.kind
    if kind is SEND_F or kind is SEND_B:
        return True
    return kind is BATCH_SEND_RECV and _holds(step.sub_steps, SEND_F, SEND_B)


def _posts_recv(step: MetaStep) -> bool:
    """A RECV_* step, or a BATCH_SEND_RECV holding one."""
    kind = step.kind
    if kind is RECV_F or kind is RECV_B:
        return True
    return kind is BATCH_SEND_RECV and _holds(step.sub_steps, RECV_F, RECV_B)


def _place(order: Order, pairing: SwapPairing, chosen: Sequence[int]) -> Order:
    """``order`` with the four swap steps of the chunks ``pairing.chunks[i]``, ``i`` in
    ``chosen`` (ascending), at the points of the module docstring."""
    if not chosen:
        return order
    t = pairing.slot_index
    chunks = pairing.chunks
    fsdp_stages = pairing.fsdp_stages
    open_unshard = pairing.open_unshard
    end = len(order)
    launch_offload: list[int] = []
    wait_offload: list[int] = []
    launch_load: list[int] = []
    wait_load: list[int] = []
    for i in chosen:
        f = pairing.fwd_slot[i]
        c = pairing.consumer_slot[i]
        chunk = chunks[i]
        point = t[f] + 1  # after the FWD's slot and its sends
        while point < end and _posts_send(order[point]):
            point += 1
        launch_offload.append(point)
        released = t[f + 2]
        wait_offload.append(released)
        consumer = t[c]
        wait_load.append(consumer)
        if chunk[0] in fsdp_stages:
            anchor = open_unshard.get(chunk, consumer)
        else:  # the last cover point: before slot c - 1 and its trailing receives
            block_start = t[c - 2] + 1
            anchor = t[c - 1]
            while anchor > block_start and _posts_recv(order[anchor - 1]):
                anchor -= 1
        launch_load.append(anchor if anchor > released else released)
    # WAIT_OFFLOAD moves up to the earliest LAUNCH_LOAD of its block (by bisection).
    loads = sorted(launch_load)
    for n, i in enumerate(chosen):
        after = bisect_right(loads, t[pairing.fwd_slot[i] + 1])
        if after < len(loads) and loads[after] < wait_offload[n]:
            wait_offload[n] = loads[after]
    # Swap steps by point; at one point by kind (life cycle), then by chunk.
    chosen_chunks = [chunks[i] for i in chosen]
    by_chunk = sorted(range(len(chosen)), key=chosen_chunks.__getitem__)
    at: dict[int, list[MetaStep]] = {}
    for kind, points in (
        (SWAP_LAUNCH_OFFLOAD, launch_offload),
        (SWAP_WAIT_OFFLOAD, wait_offload),
        (SWAP_LAUNCH_LOAD, launch_load),
        (SWAP_WAIT_LOAD, wait_load),
    ):
        for n in by_chunk:
            stage, micro = chosen_chunks[n]
            swap_step = trusted_step(kind, stage, micro)  # fields of a checked step
            point = points[n]
            bucket = at.get(point)
            if bucket is None:
                at[point] = [swap_step]
            else:
                bucket.append(swap_step)
    out: list[MetaStep] = []
    start = 0
    for point in sorted(at):
        out += order[start:point]
        out += at[point]
        start = point
    out += order[start:]
    return tuple(out)


def _wanted(
    chunks: object, rank_stages: Collection[int], gap_of: Mapping[Chunk, int]
) -> set[Chunk]:
    """The chunks of ``chunks`` on ``rank_stages``, checked (``select_chunks``)."""
    if not isinstance(chunks, Collection) or isinstance(chunks, str | bytes):
        raise TypeError(f"chunks must be a collection of (stage, micro) pairs, got {chunks!r}")
    wanted: set[Chunk] = set()
    for chunk in chunks:
        if not (
            isinstance(chunk, tuple)
            and len(chunk) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in chunk)
        ):
            raise TypeError(f"chunks must hold (stage, micro) int pairs, got {chunk!r}")
        if chunk[0] not in rank_stages:
            continue
        gap = gap_of.get(chunk)
        if gap is None:
            raise ValueError(
                f"chunks holds (stage, micro) = {chunk}, which this order does not run"
            )
        if gap < 2:
            raise ValueError(
                f"chunks holds (stage, micro) = {chunk} with gap {gap}; a swapped chunk "
                "needs gap >= 2 (room for the four swap steps)"
            )
        wanted.add(chunk)
    return wanted


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
    wanted = _wanted(chunks, rank_stages, {plan.chunk: plan.gap for plan in plans})
    return tuple(
        SwapChunkPlan(p.stage, p.micro, p.fwd_slot, p.consumer_slot, p.gap, p.chunk in wanted)
        for p in plans
    )


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
    check_order(order)
    config = _check_config(config)
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"rank must be an int in 0..{config.pp - 1}, got {rank!r}")
    if not 0 <= rank < config.pp:
        raise ValueError(f"rank must be an int in 0..{config.pp - 1}, got {rank!r}")
    if not config.swap:
        return order
    pairing = pair_chunks(order, config, rank)
    fwd_slot, consumer_slot = pairing.fwd_slot, pairing.consumer_slot
    if chunks is None:
        min_gap = config.min_swap_gap
        chosen = [
            i
            for i, (f, c) in enumerate(zip(fwd_slot, consumer_slot, strict=True))
            if c - f >= min_gap
        ]
    else:
        gap_of = {
            chunk: c - f
            for chunk, f, c in zip(pairing.chunks, fwd_slot, consumer_slot, strict=True)
        }
        wanted = _wanted(chunks, config.stages_of(rank), gap_of)
        chosen = [i for i, chunk in enumerate(pairing.chunks) if chunk in wanted]
    return _place(order, pairing, chosen)


def eligible_chunks(order: Order) -> frozenset[tuple[int, int]]:
    """The chunks ``(stage, micro)`` with a SWAP_LAUNCH_OFFLOAD in a finalized order.

    The runtime opens a swap group only for these; every other FWD runs without one.
    """
    check_order(order)
    return frozenset(step.chunk for step in order if step.kind is SWAP_LAUNCH_OFFLOAD)


def chunks_on_host_peak(order: Order, *, split_directions: bool = True) -> int:
    """The most chunks of one rank whose host copies exist at once, from its final order,
    whatever the timing. Times the bytes of a chunk, this sizes the rank's host memory.

    A chunk's host buffers are taken by its offload copy and given back when its load copy
    ends. A rank's offloads run one at a time in launch order, so when a chunk's offload
    runs, no offload launched after it has run. With a copy thread per direction (the
    runtime's ``CopyStream``, ``split_directions=True``) a load launched before it may
    still be running; it has ended once the compute thread passed its SWAP_WAIT_LOAD: the
    chunks on host are those offloaded and not yet waited for. With one thread for both
    (``split_directions=False``) every load launched before it has ended: the chunks on
    host are those offloaded and not yet loaded in launch order.
    """
    check_order(order)
    given_back = SWAP_WAIT_LOAD if split_directions else SWAP_LAUNCH_LOAD
    on_host = peak = 0
    for step in iter_leaves(order):
        if step.kind is SWAP_LAUNCH_OFFLOAD:
            on_host += 1
            peak = max(peak, on_host)
        elif step.kind is given_back:
            on_host -= 1
    return peak


def strip_swap_steps(order: Order) -> Order:
    """``order`` without its swap steps: the inverse of ``inject_swap_steps``."""
    check_order(order)
    return tuple(step for step in order if not step.is_swap)
