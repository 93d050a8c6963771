"""What the transports check of their callers' arguments, with the same messages: ranks and
message keys (the multi-process ``MPITransport`` and ``TorchDistTransport``), collective
groups (those two and ``InProcessTransport``).

Each check raises ``TypeError`` or ``ValueError`` naming the argument, its value and what
is allowed, before anything is posted.
"""

from __future__ import annotations

import sys

from ppswap.core.messages import MessageKey

__all__ = ["check_int", "check_local", "check_message_key", "check_peer_call", "group_index"]


def check_int(name: str, value: object, low: int, high: int) -> int:
    """``value`` as an int in ``[low, high)``, else TypeError/ValueError naming it."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if not low <= value < high:
        raise ValueError(f"{name}={value} out of range; allowed: {low} <= {name} < {high}")
    return value


def check_local(name: str, value: object, rank: int) -> None:
    """``value`` must be this process's ``rank``."""
    if not isinstance(value, int) or isinstance(value, bool) or value != rank:
        raise ValueError(f"{name}={value!r}; allowed: this process's rank {rank}")


def check_peer_call(
    local_name: str, local: object, peer_name: str, peer: object, rank: int, world_size: int
) -> None:
    """A point-to-point call's ranks: ``local`` is this process's ``rank``, ``peer`` any
    rank of the ``world_size``."""
    check_local(local_name, local, rank)
    check_int(peer_name, peer, 0, world_size)


def check_message_key(key: MessageKey, num_stages: int, micro_count: int) -> None:
    """A P2P key of the configured layout: direction F or B, stage and micro in range."""
    if key.direction not in ("F", "B"):
        raise ValueError(f"key.direction={key.direction!r}; allowed: 'F' or 'B'")
    check_int("key.stage", key.stage, 0, num_stages)
    check_int("key.micro", key.micro, 0, micro_count)


def group_index(group: object, rank: int, world_size: int | None) -> int:
    """``rank``'s index in a collective's ``group``: a non-empty tuple of distinct ranks of
    the world that holds ``rank`` (``world_size`` None: a world of any size)."""
    if not isinstance(group, tuple) or not group:
        raise TypeError(f"group must be a non-empty tuple of ranks, got {group!r}")
    for member in group:
        check_int("group member", member, 0, sys.maxsize if world_size is None else world_size)
    if len(set(group)) != len(group) or rank not in group:
        raise ValueError(f"group={group} must hold distinct ranks including this rank {rank}")
    return group.index(rank)
