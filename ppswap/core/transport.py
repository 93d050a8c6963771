"""The transport protocols: how a rank's messages and collectives reach other ranks.

``Transport`` moves host arrays between ranks (``send`` / ``recv``, awaited concurrently);
``CollectiveTransport`` is the collective side FSDP needs (``all_gather``,
``reduce_scatter_sum``); ``ImmediateTransport`` matches messages on the spot (every rank in
this event loop); ``MultiProcessTransport`` has one process per rank, and
``DistributedTransport`` is one the runtime configures per run and gathers results
over. Implementations: ``ppswap.actors.p2p.InProcessTransport`` (the default),
``ppswap.actors.mpi.MPITransport``.
A message is identified by ``(src, dst, MessageKey)``, unique within a run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ppswap.core.messages import HostArray, MessageKey

__all__ = [
    "CollectiveTransport",
    "DistributedTransport",
    "ImmediateTransport",
    "MultiProcessTransport",
    "Transport",
    "TransportStats",
]


@dataclass(frozen=True, slots=True)
class TransportStats:
    messages_sent: int
    messages_received: int
    bytes_sent: int
    undelivered: int


@runtime_checkable
class Transport(Protocol):
    """Moves host arrays between ranks. Both calls may be awaited concurrently."""

    async def send(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None:
        """Deliver ``payload``; returns once the payload buffer may be reused."""
        ...

    async def recv(self, dst: int, src: int, key: MessageKey) -> HostArray:
        """Wait for the message ``key`` from ``src`` and return its payload."""
        ...

    def stats(self) -> TransportStats: ...


@runtime_checkable
class CollectiveTransport(Protocol):
    """Collectives over a group of ranks (FSDP), for the calling rank. Every member passes
    the same ``group`` tuple and ``key``, and makes the same calls in the same order."""

    async def all_gather(
        self, rank: int, group: tuple[int, ...], key: str, array: HostArray
    ) -> list[HostArray]:
        """Every member's ``array``, in ``group`` order (``rank`` is the caller)."""
        ...

    async def reduce_scatter_sum(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[HostArray]
    ) -> HostArray:
        """The sum over members of what they sent to ``rank`` (``arrays[j]`` goes to
        ``group[j]``), a left fold in ``group`` order."""
        ...


@runtime_checkable
class ImmediateTransport(Protocol):
    """A transport that matches messages on the spot (all ranks in this event loop).

    ``deliver`` hands ``payload`` over (it never blocks); ``expect`` calls ``on_arrival``
    with the payload once it is there (at once if it already is). Both run on the loop.
    """

    def deliver(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None: ...

    def expect(
        self, dst: int, src: int, key: MessageKey, on_arrival: Callable[[HostArray], None]
    ) -> None: ...


@runtime_checkable
class MultiProcessTransport(Protocol):
    """A transport whose ranks are separate processes: this process is rank ``rank`` of
    ``world_size``."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...


@runtime_checkable
class DistributedTransport(MultiProcessTransport, Protocol):
    """A multi-process transport the runtime can configure per run and gather results
    over (MPITransport)."""

    def configure(self, num_stages: int, micro_count: int) -> None: ...

    async def all_gather(
        self, rank: int, group: tuple[int, ...], key: str, array: HostArray
    ) -> list[HostArray]: ...
