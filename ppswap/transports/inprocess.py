"""``InProcessTransport``: every rank in this process and event loop (the default).

A mailbox per message: a send never blocks (the payload waits in the mailbox until its
receiver takes it), which is the buffered-send semantics the schedule validator assumes.
It is an ``ImmediateTransport`` (``deliver`` / ``expect``: the P2P actor serves it
without a task) and serves the awaitable ``send`` / ``recv`` too (with a fault plan).
Collectives (FSDP's, and the all-to-all of expert parallelism) are a rendezvous per call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import numpy as np

from ppswap.core.messages import HostArray, MessageKey
from ppswap.core.rank_args import group_index
from ppswap.core.transport import TransportStats, check_all_to_all, sum_contributions
from ppswap.transports.payloads import payload_nbytes

__all__ = ["InProcessTransport"]


@dataclass(slots=True)
class _Rendezvous:
    group: tuple[int, ...]
    contributions: dict[int, tuple[HostArray, ...]] = field(default_factory=dict)
    complete: anyio.Event = field(default_factory=anyio.Event)
    taken: int = 0


@dataclass(slots=True)
class _Mailbox:
    payload: HostArray | None = None
    arrived: bool = False
    on_arrival: Callable[[HostArray], None] | None = None
    waiter: anyio.Event | None = None


class InProcessTransport:
    """All ranks in one process and one event loop: a mailbox per message.

    A send never blocks (the payload is parked in the mailbox until its receiver takes
    it), which is the buffered-send semantics the schedule validator assumes. Both the
    awaitable ``send``/``recv`` and the immediate ``deliver``/``expect`` are served.
    """

    def __init__(self) -> None:
        self._mailboxes: dict[tuple[int, int, MessageKey], _Mailbox] = {}
        self._rendezvous: dict[tuple[str, tuple[int, ...], str, int], _Rendezvous] = {}
        self._collective_calls: dict[tuple[str, tuple[int, ...], str, int], int] = {}
        self._sent = 0
        self._received = 0
        self._bytes_sent = 0

    def _box(self, src: int, dst: int, key: MessageKey) -> _Mailbox:
        box = self._mailboxes.get((src, dst, key))
        if box is None:
            box = self._mailboxes[(src, dst, key)] = _Mailbox()
        return box

    def deliver(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None:
        box = self._box(src, dst, key)
        if box.arrived:
            raise RuntimeError(f"message {key} from rank {src} to rank {dst} sent twice")
        self._sent += 1
        self._bytes_sent += payload_nbytes(payload)
        if box.on_arrival is not None:
            del self._mailboxes[(src, dst, key)]
            self._received += 1
            box.on_arrival(payload)
            return
        box.payload, box.arrived = payload, True
        if box.waiter is not None:
            box.waiter.set()

    def expect(
        self, dst: int, src: int, key: MessageKey, on_arrival: Callable[[HostArray], None]
    ) -> None:
        box = self._box(src, dst, key)
        if box.on_arrival is not None or box.waiter is not None:
            raise RuntimeError(f"message {key} from rank {src} to rank {dst} received twice")
        if box.arrived:
            del self._mailboxes[(src, dst, key)]
            self._received += 1
            assert box.payload is not None
            on_arrival(box.payload)
            return
        box.on_arrival = on_arrival

    async def send(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None:
        self.deliver(src, dst, key, payload)

    async def recv(self, dst: int, src: int, key: MessageKey) -> HostArray:
        box = self._box(src, dst, key)
        if not box.arrived:
            if box.on_arrival is not None or box.waiter is not None:
                raise RuntimeError(f"message {key} from rank {src} to rank {dst} received twice")
            box.waiter = anyio.Event()
            await box.waiter.wait()
        del self._mailboxes[(src, dst, key)]
        self._received += 1
        assert box.payload is not None
        return box.payload

    def stats(self) -> TransportStats:
        undelivered = sum(1 for box in self._mailboxes.values() if box.arrived)
        return TransportStats(self._sent, self._received, self._bytes_sent, undelivered)

    def reset(self) -> None:
        """Drop undelivered messages (after a failed or cancelled run)."""
        self._mailboxes.clear()
        self._rendezvous.clear()
        self._collective_calls.clear()

    async def all_gather(
        self, rank: int, group: tuple[int, ...], key: str, array: HostArray
    ) -> list[HostArray]:
        """Every member's ``array`` (the arrays themselves, not copies), in group order."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"array must be a numpy.ndarray, got {type(array).__name__}")
        found = await self._rendezvous_wait("all_gather", rank, group, key, (array,))
        return [found[index][0] for index in range(len(group))]

    async def reduce_scatter_sum(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[HostArray]
    ) -> HostArray:
        """The sum over members of their ``arrays[i]`` (``group[i] == rank``), a left fold
        in group order (bit-identical from run to run), in a new array."""
        parts = await self._per_member_exchange("reduce_scatter_sum", rank, group, key, arrays)
        return sum_contributions(key, group, rank, parts)

    async def all_to_all(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[HostArray]
    ) -> list[HostArray]:
        """What every member sent to ``rank`` (its ``arrays[group.index(rank)]``), in group
        order: the arrays themselves, any number of rows each (``check_all_to_all``)."""
        parts = await self._per_member_exchange("all_to_all", rank, group, key, arrays)
        return check_all_to_all(key, group, rank, arrays[group.index(rank)], parts)

    async def _per_member_exchange(
        self, op: str, rank: int, group: tuple[int, ...], key: str, arrays: list[HostArray]
    ) -> list[HostArray]:
        """``arrays[j]`` goes to ``group[j]``: what every member gave ``rank``, in group
        order (the arrays themselves)."""
        if len(arrays) != len(group) or not all(isinstance(a, np.ndarray) for a in arrays):
            raise ValueError(
                f"arrays must hold {len(group)} numpy arrays, one per member of group "
                f"{group}, got {len(arrays)} items"
            )
        found = await self._rendezvous_wait(op, rank, group, key, tuple(arrays))
        mine = group.index(rank)
        return [found[index][mine] for index in range(len(group))]

    async def _rendezvous_wait(
        self,
        op: str,
        rank: int,
        group: tuple[int, ...],
        key: str,
        payload: tuple[HostArray, ...],
    ) -> dict[int, tuple[HostArray, ...]]:
        """Wait until every member of ``group`` contributed to the same call; return the
        contributions by member index. The n-th call of ``(op, group, key)`` by each member
        meet (a key may be reused, as with MPITransport)."""
        mine = group_index(group, rank, None)
        members = tuple(sorted(group))
        call = (op, members, key, rank)
        count = self._collective_calls.get(call, 0)
        self._collective_calls[call] = count + 1
        slot_key = (op, members, key, count)
        slot = self._rendezvous.get(slot_key)
        if slot is None:
            slot = self._rendezvous[slot_key] = _Rendezvous(group)
        if slot.group != group:
            raise RuntimeError(
                f"{op} {key!r}: members disagree on the group order: {slot.group} and {group}"
            )
        slot.contributions[mine] = payload
        if len(slot.contributions) == len(group):
            slot.complete.set()
        await slot.complete.wait()
        slot.taken += 1
        if slot.taken == len(group):
            del self._rendezvous[slot_key]
        return slot.contributions
