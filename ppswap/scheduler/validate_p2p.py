"""The P2P rules: per rank, the sends and receives between two compute slots are the ones
the data dependencies imply, fused where ``p2p='batch'``; across ranks, every send has its
receive, in the same order on each channel (module docstring of
``ppswap.scheduler.validate``)."""

from __future__ import annotations

from collections import Counter
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
from ppswap.scheduler.steps import BATCH_SEND_RECV, P2P_KINDS, SEND_KINDS, MetaStep, Order
from ppswap.scheduler.validate_errors import ScheduleValidationError

__all__ = [
    "check_batch_runs",
    "check_p2p_gaps",
    "describe_message",
    "p2p_leaves",
    "validate_p2p_pairs",
]


def _gap_p2p(gap: Iterable[MetaStep]) -> Counter[MetaStep]:
    found: Counter[MetaStep] = Counter()
    for step in gap:
        if step.kind is BATCH_SEND_RECV:
            found.update(step.sub_steps)
        elif step.kind in P2P_KINDS:
            found[step] += 1
    return found


def check_p2p_gaps(config: ScheduleConfig, rank: int, order: Order) -> None:
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


def check_batch_runs(rank: int, order: Order) -> None:
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


def describe_message(key: MessageKey) -> str:
    """The send a message key stands for, in words (for error messages)."""
    src, dst, direction, stage, micro = key
    sender_stage = stage - 1 if direction == "F" else stage + 1
    return f"SEND_{direction}(stage {sender_stage}, micro {micro}) from rank {src} to rank {dst}"


def p2p_leaves(order: Order) -> Iterable[MetaStep]:
    """Every send and receive of ``order``, a batch's unpacked, in order."""
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
        for step in p2p_leaves(order):
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
                    f"{describe_message(send) if send else 'no send'} on the sending side but "
                    f"{describe_message(recv) if recv else 'no receive'} on the receiving side"
                )
