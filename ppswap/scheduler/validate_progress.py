"""The cross-rank progress simulation: every rank's order played until all finish or all
unfinished ones wait (module docstring of ``ppswap.scheduler.validate``)."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from ppswap.scheduler.analysis import MessageKey, check_orders, message_key
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.render import format_grid
from ppswap.scheduler.steps import (
    BATCH_SEND_RECV,
    RECV_B,
    RECV_F,
    SEND_B,
    SEND_F,
    SEND_KINDS,
    Order,
)
from ppswap.scheduler.validate_errors import ScheduleDeadlockError
from ppswap.scheduler.validate_p2p import describe_message, p2p_leaves

__all__ = ["simulate_progress"]

_DEADLOCK_WINDOW = 6
"""Steps shown on each side of where a rank is stuck."""


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
        for step in p2p_leaves(order)
        if step.kind in SEND_KINDS
    }
    lines = [f"schedule deadlock: ranks {sorted(blocked_on)} are blocked"]
    for rank in sorted(blocked_on):
        key = blocked_on[rank]
        position = positions[rank]
        note = "" if key in sent_anywhere else " (no rank's order contains it)"
        lines.append(
            f"  rank {rank} waits at step {position} ({orders[rank][position].short()}) for "
            f"{describe_message(key)}{note}"
        )
    finished = [r for r in range(len(orders)) if r not in blocked_on]
    if finished:
        lines.append(f"  finished ranks: {finished}")
    stuck = {rank: positions[rank] for rank in blocked_on}
    lines.append(format_grid(orders, marks=stuck, window=_DEADLOCK_WINDOW))
    return ScheduleDeadlockError("\n".join(lines), stuck)
