"""Validation of orders: per-rank invariants, cross-rank P2P pairing, progress simulation.

``validate_order``
    One rank's invariants. Every step names a stage of the rank; every chunk
    ``(stage, micro)`` of the rank has exactly one FWD and, unless forward-only, exactly
    one BWD or one BWD_INPUT + one BWD_WEIGHT (the split only where
    ``config.splits_backward``: with ``split_dw`` never on stage 0; the zero-bubble
    families and a given order split any stage); FWD comes in an earlier compute slot
    than its backward, BWD_INPUT in an earlier one than its BWD_WEIGHT; composites are
    ``OVERLAP_B_F(BWD|BWD_INPUT, FWD)`` or ``OVERLAP_F_B(FWD, BWD|BWD_INPUT)`` and exist
    only where ``config.has_composites``. With ``lowered=True`` (the default: a finalized
    order) also: the P2P steps between two compute slots are exactly the sends of the
    earlier slot and the recvs of the later one, derived from the compute slots and the
    stage -> rank placement (``analysis.expected_p2p``, not lowering's code); in batch
    mode consecutive P2P steps are fused into one BATCH_SEND_RECV (two or more steps; a
    lone step is bare), in the other modes there is no BATCH_SEND_RECV; FSDP steps only with
    ``fsdp``, and every compute leaf runs while its stage is unsharded (UNSHARD and
    RESHARD alternate per stage, starting and ending sharded); swap steps only with
    ``swap`` and at top level; a RECOMPUTE at most once per chunk, at top level, after
    the chunk's FWD and before its BWD / BWD_INPUT (never in a forward-only order), with
    FSDP while its stage is unsharded. ``lowered=False`` checks a compute order (compute
    slots only).
``validate_p2p_pairs``
    Across ranks: every send has its receive and the other way round, with matching
    peers, and on each channel ``(src rank, dst rank, F|B)`` the sends and the receives
    come in the same order (so FIFO transports and tag-matching transports both work).
``simulate_progress``
    Plays every rank's order. Sends never block; a RECV blocks until its matching SEND
    has executed (a RECV is placed directly before its consumer, so this is the moment
    the consumer awaits it); a BATCH_SEND_RECV posts all its sends, then waits for all
    its recvs. Compute, FSDP and swap steps are local and never block. If every
    unfinished rank is blocked, it raises ``ScheduleDeadlockError`` whose message shows
    each rank's order around the step where it is stuck (marked ``>>``).
``validate_all``
    All of the above on a full set of finalized orders.

All errors are ``ScheduleValidationError`` (a ValueError); the deadlock error is a
subclass of it.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence

from ppswap.scheduler.analysis import (
    MessageKey,
    check_orders,
    compute_slots,
    expected_p2p,
    message_key,
    p2p_partner_stage,
)
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.render import format_grid
from ppswap.scheduler.schedules import check_rank
from ppswap.scheduler.steps import (
    BATCH_SEND_RECV,
    BWD,
    BWD_INPUT,
    BWD_WEIGHT,
    COMPOSITE_KINDS,
    COMPUTE_KINDS,
    CONSUMER_KINDS,
    FSDP_KINDS,
    FWD,
    P2P_KINDS,
    RECOMPUTE,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    SEND_KINDS,
    SWAP_KINDS,
    MetaStep,
    Order,
    StepKind,
)

__all__ = [
    "ScheduleDeadlockError",
    "ScheduleValidationError",
    "simulate_progress",
    "validate_all",
    "validate_order",
    "validate_p2p_pairs",
]


_DEADLOCK_WINDOW = 6


class ScheduleValidationError(ValueError):
    """An order breaks an invariant of the schedule IR."""


class ScheduleDeadlockError(ScheduleValidationError):
    """The cross-rank simulation stopped with every unfinished rank blocked.

    ``stuck`` maps each blocked rank to the index of the step it waits at.
    """

    def __init__(self, message: str, stuck: dict[int, int]) -> None:
        super().__init__(message)
        self.stuck = stuck


def _leaves(step: MetaStep) -> tuple[MetaStep, ...]:
    return step.sub_steps if step.sub_steps else (step,)


# -- one rank ---------------------------------------------------------------------------------
def _check_shape(
    config: ScheduleConfig, rank: int, index: int, step: MetaStep, lowered: bool
) -> None:
    """Allowed kinds at top level and the shape of containers and composites."""
    kind = step.kind
    where = f"rank {rank} step {index} ({step.short()})"
    if kind in COMPOSITE_KINDS:
        if not config.has_composites:
            raise ScheduleValidationError(f"{where}: composites need overlap_b_f=True")
        subs = [sub.kind for sub in step.sub_steps]
        if kind is StepKind.OVERLAP_F_B:
            subs.reverse()  # OVERLAP_F_B(FWD, backward): the same pair, forward first
        if len(subs) != 2 or subs[0] not in CONSUMER_KINDS or subs[1] is not FWD:
            raise ScheduleValidationError(
                f"{where}: a composite must be OVERLAP_B_F(BWD or BWD_INPUT, FWD) or "
                "OVERLAP_F_B(FWD, BWD or BWD_INPUT)"
            )
        return
    if kind in COMPUTE_KINDS:
        return
    if not lowered:
        raise ScheduleValidationError(
            f"{where}: a compute order holds compute slots only, got {kind.value}"
        )
    if kind is BATCH_SEND_RECV:
        if config.p2p != "batch":
            raise ScheduleValidationError(
                f"{where}: BATCH_SEND_RECV only with p2p='batch', got p2p={config.p2p!r}"
            )
        if len(step.sub_steps) < 2:
            raise ScheduleValidationError(
                f"{where}: a BATCH_SEND_RECV fuses two or more P2P steps (a lone step stays bare)"
            )
        for sub in step.sub_steps:
            if sub.kind not in P2P_KINDS:
                raise ScheduleValidationError(
                    f"{where}: BATCH_SEND_RECV holds P2P steps only, got {sub.kind.value}"
                )
    elif kind in FSDP_KINDS:
        if not config.fsdp:
            raise ScheduleValidationError(f"{where}: FSDP steps need fsdp=True")
    elif kind in SWAP_KINDS and not config.swap:
        raise ScheduleValidationError(f"{where}: swap steps need swap=True")


def _check_placement(
    config: ScheduleConfig, rank: int, index: int, step: MetaStep, own_stages: frozenset[int]
) -> None:
    for leaf in _leaves(step):
        if leaf.stage not in own_stages:
            raise ScheduleValidationError(
                f"rank {rank} step {index} ({leaf.short()}): stage {leaf.stage} is not on "
                f"rank {rank} (its stages are {sorted(own_stages)})"
            )
        if leaf.kind in FSDP_KINDS:
            if leaf.micro != -1:
                raise ScheduleValidationError(
                    f"rank {rank} step {index}: FSDP steps have micro -1, got {leaf.micro}"
                )
        elif not 0 <= leaf.micro < config.micro:
            raise ScheduleValidationError(
                f"rank {rank} step {index} ({leaf.short()}): micro must be in "
                f"0..{config.micro - 1}, got {leaf.micro}"
            )


def _check_chunks(config: ScheduleConfig, rank: int, order: Order) -> None:
    """Exactly one FWD and one backward (BWD, or BWD_INPUT + BWD_WEIGHT) per chunk."""
    slots: dict[StepKind, dict[tuple[int, int], int]] = {
        FWD: {},
        BWD: {},
        BWD_INPUT: {},
        BWD_WEIGHT: {},
    }
    for slot in compute_slots(order):
        for leaf in slot.leaves:
            seen = slots[leaf.kind]
            if leaf.chunk in seen:
                raise ScheduleValidationError(
                    f"rank {rank}: {leaf.kind.value} of chunk (stage {leaf.stage}, micro "
                    f"{leaf.micro}) appears twice (compute slots {seen[leaf.chunk]} and "
                    f"{slot.slot})"
                )
            seen[leaf.chunk] = slot.slot
    split_seen = slots[BWD_INPUT] or slots[BWD_WEIGHT]
    if config.forward_only and (slots[BWD] or split_seen):
        raise ScheduleValidationError(f"rank {rank}: a forward-only order has FWDs only")
    if split_seen and not config.splits_backward:
        raise ScheduleValidationError(f"rank {rank}: BWD_INPUT/BWD_WEIGHT need split_dw=True")
    for stage in config.stages_of(rank):
        for micro in range(config.micro):
            chunk = (stage, micro)
            where = f"rank {rank} chunk (stage {stage}, micro {micro})"
            fwd = slots[FWD].get(chunk)
            if fwd is None:
                raise ScheduleValidationError(f"{where}: no FWD")
            if config.forward_only:
                continue
            bwd = slots[BWD].get(chunk)
            first = slots[BWD_INPUT].get(chunk)
            weight = slots[BWD_WEIGHT].get(chunk)
            if bwd is not None and (first is not None or weight is not None):
                raise ScheduleValidationError(f"{where}: both BWD and BWD_INPUT/BWD_WEIGHT")
            if bwd is None and (first is None or weight is None):
                raise ScheduleValidationError(
                    f"{where}: needs one BWD, or one BWD_INPUT and one BWD_WEIGHT"
                )
            if stage == 0 and bwd is None and config.split_dw:
                raise ScheduleValidationError(f"{where}: stage 0 keeps a unified BWD")
            consumer = bwd if bwd is not None else first
            assert consumer is not None
            if not fwd < consumer:
                raise ScheduleValidationError(
                    f"{where}: FWD (compute slot {fwd}) must come before its backward "
                    f"(compute slot {consumer})"
                )
            if weight is not None and not consumer < weight:
                raise ScheduleValidationError(
                    f"{where}: BWD_INPUT (compute slot {consumer}) must come before "
                    f"BWD_WEIGHT (compute slot {weight})"
                )


def _gap_p2p(gap: Iterable[MetaStep]) -> Counter[MetaStep]:
    found: Counter[MetaStep] = Counter()
    for step in gap:
        if step.kind is BATCH_SEND_RECV:
            found.update(step.sub_steps)
        elif step.kind in P2P_KINDS:
            found[step] += 1
    return found


def _check_p2p_gaps(config: ScheduleConfig, rank: int, order: Order) -> None:
    """The P2P steps of each gap are the previous slot's sends and the next slot's recvs,
    as the data dependencies and the stage placement imply (``analysis.expected_p2p``)."""
    previous_sends: tuple[MetaStep, ...] = ()
    previous = "the start"
    gap_start = 0
    for slot in compute_slots(order):
        recvs, sends = expected_p2p(slot.leaves, config)
        gap = order[gap_start : slot.index]
        _compare_gap(rank, gap, previous_sends + recvs, previous, slot.step.short())
        gap_start = slot.index + 1
        previous_sends = sends
        previous = slot.step.short()
    _compare_gap(rank, order[gap_start:], previous_sends, previous, "the end")


def _compare_gap(
    rank: int, gap: Sequence[MetaStep], expected: tuple[MetaStep, ...], after: str, before: str
) -> None:
    found = _gap_p2p(gap)
    wanted = Counter(expected)
    if found != wanted:
        missing = " ".join(s.short() for s in (wanted - found).elements()) or "none"
        extra = " ".join(s.short() for s in (found - wanted).elements()) or "none"
        raise ScheduleValidationError(
            f"rank {rank}: P2P steps between {after} and {before} do not match the data "
            f"dependencies: missing {missing}; unexpected {extra}"
        )


def _check_batch_runs(rank: int, order: Order) -> None:
    """Batch mode: no two P2P steps or batches are adjacent (they would be one batch)."""
    previous_is_p2p = False
    for index, step in enumerate(order):
        is_p2p = step.kind is BATCH_SEND_RECV or step.kind in P2P_KINDS
        if is_p2p and previous_is_p2p:
            raise ScheduleValidationError(
                f"rank {rank} step {index} ({step.short()}): consecutive P2P steps must be "
                "fused into one BATCH_SEND_RECV with p2p='batch'"
            )
        previous_is_p2p = is_p2p


def _check_fsdp_states(rank: int, order: Order) -> None:
    unsharded: set[int] = set()
    touched: set[int] = set()
    for index, step in enumerate(order):
        kind = step.kind
        if kind is StepKind.FSDP_UNSHARD:
            if step.stage in unsharded:
                raise ScheduleValidationError(
                    f"rank {rank} step {index}: FSDP_UNSHARD of stage {step.stage} while "
                    "it is already unsharded"
                )
            unsharded.add(step.stage)
            touched.add(step.stage)
        elif kind is StepKind.FSDP_RESHARD:
            if step.stage not in unsharded:
                raise ScheduleValidationError(
                    f"rank {rank} step {index}: FSDP_RESHARD of stage {step.stage} while "
                    "it is sharded"
                )
            unsharded.discard(step.stage)
        elif step.is_compute or kind is RECOMPUTE:
            for leaf in _leaves(step):
                if leaf.stage not in unsharded:
                    raise ScheduleValidationError(
                        f"rank {rank} step {index} ({leaf.short()}): stage {leaf.stage} "
                        "runs while its parameters are sharded (no FSDP_UNSHARD before it)"
                    )
    if unsharded:
        raise ScheduleValidationError(
            f"rank {rank}: stages {sorted(unsharded)} are still unsharded at the end "
            "(missing FSDP_RESHARD)"
        )


def _check_recompute(config: ScheduleConfig, rank: int, order: Order) -> None:
    """Each RECOMPUTE: one per chunk, after the chunk's FWD, before its BWD/BWD_INPUT."""
    fwd_seen: set[tuple[int, int]] = set()
    pending: dict[tuple[int, int], int] = {}
    done: set[tuple[int, int]] = set()
    for index, step in enumerate(order):
        if step.kind is RECOMPUTE:
            where = f"rank {rank} step {index} ({step.short()})"
            if config.forward_only:
                raise ScheduleValidationError(f"{where}: a forward-only order recomputes nothing")
            if step.chunk in pending or step.chunk in done:
                raise ScheduleValidationError(f"{where}: a chunk is recomputed at most once")
            if step.chunk not in fwd_seen:
                raise ScheduleValidationError(f"{where}: RECOMPUTE before the chunk's FWD")
            pending[step.chunk] = index
            continue
        for leaf in _leaves(step):
            if leaf.kind is FWD:
                fwd_seen.add(leaf.chunk)
            elif leaf.kind in CONSUMER_KINDS and leaf.chunk in pending:
                del pending[leaf.chunk]
                done.add(leaf.chunk)
            elif leaf.kind is BWD_WEIGHT and leaf.chunk in pending:
                raise ScheduleValidationError(
                    f"rank {rank} step {pending[leaf.chunk]}: RECOMPUTE of chunk {leaf.chunk} "
                    "comes after its BWD_INPUT (BWD_WEIGHT never recomputes)"
                )
    if pending:
        chunk, index = next(iter(pending.items()))
        raise ScheduleValidationError(
            f"rank {rank} step {index}: RECOMPUTE of chunk {chunk} has no backward after it"
        )


def validate_order(
    config: ScheduleConfig, rank: int, order: Order, *, lowered: bool = True
) -> None:
    """Check one rank's order (module docstring); raise ScheduleValidationError."""
    check_rank(config, rank)
    if not isinstance(order, tuple):
        raise TypeError(f"order must be a tuple of MetaStep, got {type(order).__name__}")
    own_stages = frozenset(config.stages_of(rank))
    for index, step in enumerate(order):
        if not isinstance(step, MetaStep):
            raise TypeError(f"order[{index}] must be a MetaStep, got {step!r}")
        _check_shape(config, rank, index, step, lowered)
        _check_placement(config, rank, index, step, own_stages)
    _check_chunks(config, rank, order)
    if lowered:
        _check_recompute(config, rank, order)
        _check_p2p_gaps(config, rank, order)
        if config.p2p == "batch":
            _check_batch_runs(rank, order)
        if config.fsdp:
            _check_fsdp_states(rank, order)


# -- across ranks -----------------------------------------------------------------------------
def _describe_key(key: MessageKey) -> str:
    src, dst, direction, stage, micro = key
    sender_stage = stage - 1 if direction == "F" else stage + 1
    return f"SEND_{direction}(stage {sender_stage}, micro {micro}) from rank {src} to rank {dst}"


def _p2p_leaves(order: Order) -> Iterable[MetaStep]:
    for step in order:
        if step.kind is BATCH_SEND_RECV:
            yield from step.sub_steps
        elif step.kind in P2P_KINDS:
            yield step


def validate_p2p_pairs(config: ScheduleConfig, orders: Sequence[Order]) -> None:
    """Check that sends and receives pair up across ranks, in order, per channel."""
    check_orders(config, orders)
    num_stages = config.num_stages
    sent: dict[tuple[int, int, str], list[MessageKey]] = {}
    received: dict[tuple[int, int, str], list[MessageKey]] = {}
    for rank, order in enumerate(orders):
        for step in _p2p_leaves(order):
            partner = p2p_partner_stage(step)
            if not 0 <= partner < num_stages or step.peer != config.rank_of(partner):
                raise ScheduleValidationError(
                    f"rank {rank}: {step.short()} (peer {step.peer}) has no partner stage: "
                    f"stage {partner} is not in 0..{num_stages - 1} or not on rank {step.peer}"
                )
            key = message_key(rank, step)
            book = sent if step.kind in SEND_KINDS else received
            book.setdefault(key[:3], []).append(key)
    for channel in sorted(set(sent) | set(received)):
        sends = sent.get(channel, [])
        recvs = received.get(channel, [])
        src, dst, direction = channel
        for position in range(max(len(sends), len(recvs))):
            send = sends[position] if position < len(sends) else None
            recv = recvs[position] if position < len(recvs) else None
            if send != recv:
                raise ScheduleValidationError(
                    f"channel rank {src} -> rank {dst} ({direction}): message #{position} is "
                    f"{_describe_key(send) if send else 'no send'} on the sending side but "
                    f"{_describe_key(recv) if recv else 'no receive'} on the receiving side"
                )


def simulate_progress(config: ScheduleConfig, orders: Sequence[Order]) -> None:
    """Play all ranks; raise ScheduleDeadlockError if they stop before the end."""
    check_orders(config, orders)
    pp = config.pp
    delivered: set[MessageKey] = set()
    waiting: dict[MessageKey, list[int]] = {}
    positions = [0] * pp
    batch_posted = [False] * pp
    blocked_on: dict[int, MessageKey] = {}
    ready: deque[int] = deque(range(pp))

    def deliver(key: MessageKey) -> None:
        delivered.add(key)
        for waiter in waiting.pop(key, ()):
            blocked_on.pop(waiter, None)
            ready.append(waiter)

    while ready:
        rank = ready.popleft()
        order = orders[rank]
        position = positions[rank]
        end = len(order)
        while position < end:
            step = order[position]
            kind = step.kind
            missing: MessageKey | None = None
            if kind is SEND_F or kind is SEND_B:
                deliver(message_key(rank, step))
            elif kind is RECV_F or kind is RECV_B:
                key = message_key(rank, step)
                if key not in delivered:
                    missing = key
            elif kind is BATCH_SEND_RECV:
                if not batch_posted[rank]:
                    batch_posted[rank] = True
                    for sub in step.sub_steps:
                        if sub.kind in SEND_KINDS:
                            deliver(message_key(rank, sub))
                for sub in step.sub_steps:
                    if sub.kind not in SEND_KINDS:
                        key = message_key(rank, sub)
                        if key not in delivered:
                            missing = key
                            break
                if missing is None:
                    batch_posted[rank] = False
            if missing is not None:
                waiting.setdefault(missing, []).append(rank)
                blocked_on[rank] = missing
                break
            position += 1
        positions[rank] = position
    if blocked_on:
        raise _deadlock(orders, positions, blocked_on)


def _deadlock(
    orders: Sequence[Order], positions: list[int], blocked_on: dict[int, MessageKey]
) -> ScheduleDeadlockError:
    sent_anywhere = {
        message_key(rank, step)
        for rank, order in enumerate(orders)
        for step in _p2p_leaves(order)
        if step.kind in SEND_KINDS
    }
    lines = [f"schedule deadlock: ranks {sorted(blocked_on)} are blocked"]
    for rank in sorted(blocked_on):
        key = blocked_on[rank]
        position = positions[rank]
        note = "" if key in sent_anywhere else " (no rank's order contains it)"
        lines.append(
            f"  rank {rank} waits at step {position} ({orders[rank][position].short()}) for "
            f"{_describe_key(key)}{note}"
        )
    finished = [r for r in range(len(orders)) if r not in blocked_on]
    if finished:
        lines.append(f"  finished ranks: {finished}")
    stuck = {rank: positions[rank] for rank in blocked_on}
    lines.append(format_grid(orders, marks=stuck, window=_DEADLOCK_WINDOW))
    return ScheduleDeadlockError("\n".join(lines), stuck)


def validate_all(config: ScheduleConfig, orders: Sequence[Order]) -> None:
    """Every per-rank check, the cross-rank pairing and the progress simulation."""
    check_orders(config, orders)
    for rank, order in enumerate(orders):
        validate_order(config, rank, order)
    validate_p2p_pairs(config, orders)
    simulate_progress(config, orders)
