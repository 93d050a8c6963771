"""Typed envelopes the actors exchange: a MetaStep, a payload and a reply future.

Channels between actors are bounded, and compute -> P2P -> compute is a cycle, so replies
never travel back over a channel: every request carries its own ``ReplyFuture``, resolved
exactly once by the actor that serves it and awaited (with a deadline) by the requester.
"""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeAlias, TypeVar

import numpy.typing as npt

from ppswap.core.arrival import Arrival
from ppswap.core.deadlines import resolve, wait_woken
from ppswap.scheduler.steps import MetaStep

__all__ = [
    "CollectiveOp",
    "CollectiveRequest",
    "FutureTimeoutError",
    "HostArray",
    "MessageKey",
    "P2PRequest",
    "Payload",
    "RecvRequest",
    "ReplyFuture",
    "RequestSink",
    "SendRequest",
]

T = TypeVar("T")

# A host buffer: what crosses between processes and between the host and the "device".
HostArray: TypeAlias = npt.NDArray[Any]

# What a P2P message carries: a host array, or (between ranks of one process) whatever the
# stages' backend passes between them (``Backend.to_payload``).
Payload: TypeAlias = Any


class FutureTimeoutError(TimeoutError):
    """A ReplyFuture was not resolved within its deadline."""


class ReplyFuture(Generic[T]):
    """A one-shot result slot on the event loop: set once, awaited by anyone.

    Resolve with ``set_result`` / ``set_exception`` from the event loop thread only.
    ``wait(timeout)`` raises ``FutureTimeoutError`` when the deadline passes, so no
    waiter can hang. ``result()`` reads a resolved future without waiting. A waiter's
    loop future is made only when someone has to wait (most replies are there before
    anyone asks for them); the deadline is one loop timer (``core.deadlines``).

    ``arrival``: a thread-side twin (``core.arrival``) landed with the same result when
    the future resolves, for a compute thread that waits for a receive itself.
    """

    __slots__ = ("__weakref__", "_done", "_error", "_result", "_waiters", "arrival", "label")

    def __init__(self, label: str, arrival: Arrival | None = None) -> None:
        self.label = label
        self.arrival = arrival
        self._done = False
        self._waiters: list[asyncio.Future[None]] = []
        self._result: T | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done

    def set_result(self, value: T) -> None:
        if self._done:
            raise RuntimeError(f"future {self.label} resolved twice")
        self._result = value
        self._resolve()

    def set_exception(self, error: BaseException) -> None:
        if self._done:
            raise RuntimeError(f"future {self.label} resolved twice")
        self._error = error
        self._resolve()

    def fail(self, error: BaseException) -> None:
        """Resolve with ``error`` unless already resolved (a failing server's last act)."""
        if not self._done:
            self.set_exception(error)

    def _resolve(self) -> None:
        self._done = True
        if self.arrival is not None:
            self.arrival.land(self._result, self._error)
        for waiter in self._waiters:
            resolve(waiter)

    def result(self) -> T:
        """The value (or raise the error) of a resolved future."""
        if not self._done:
            raise RuntimeError(f"future {self.label} is not resolved yet")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]

    async def wait(self, timeout: float = math.inf) -> T:
        if not self._done:
            waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await wait_woken(waiter, timeout)
            finally:
                self._waiters.remove(waiter)
            if not self._done:
                raise FutureTimeoutError(f"{self.label} not resolved within {timeout}s")
        return self.result()


class MessageKey(NamedTuple):
    """Identifies one P2P message of a run: direction, receiving stage, micro-batch.

    ``direction`` is ``"F"`` (activation, stage s-1 -> s) or ``"B"`` (gradient,
    stage s+1 -> s); ``stage`` is always the *receiving* stage, so a SEND_F(s, i) travels
    under ``MessageKey("F", s + 1, i)``. A named tuple: made, hashed and compared in C
    (keys are made and looked up several times per step).
    """

    direction: str
    stage: int
    micro: int

    def tag(self, num_stages: int, micro_count: int) -> int:
        """A unique non-negative integer for transports that need integer tags."""
        direction_index = 0 if self.direction == "F" else 1
        return (direction_index * num_stages + self.stage) * micro_count + self.micro


@dataclass(frozen=True, slots=True)
class SendRequest:
    """Compute -> P2P: deliver ``payload`` to ``dst`` under ``key``."""

    step: MetaStep
    key: MessageKey
    dst: int
    payload: Payload
    reply: ReplyFuture[None] = field(compare=False)


@dataclass(frozen=True, slots=True)
class RecvRequest:
    """Compute -> P2P: receive ``key`` from ``src``; the payload resolves ``reply``."""

    step: MetaStep
    key: MessageKey
    src: int
    reply: ReplyFuture[Payload] = field(compare=False)


CollectiveOp = Literal["all_gather", "reduce_scatter_sum", "all_to_all"]


@dataclass(frozen=True, slots=True)
class CollectiveRequest:
    """Compute (FSDP driver) -> P2P: one collective over the dp ``group`` (world ranks).

    ``all_gather``: ``payload`` is this rank's one array; ``reply`` gets every member's
    array in ``group`` order. ``reduce_scatter_sum``: ``payload`` holds one array per
    member (``payload[j]`` goes to ``group[j]``); ``reply`` gets one array, the sum of
    what every member sent to this rank. ``all_to_all`` (expert parallelism):
    ``payload[j]`` goes to ``group[j]`` (any number of rows, zero included); ``reply``
    gets what every member sent to this rank, in ``group`` order. Every member issues
    the same ``(op, group, key)`` calls in the same order; ``key`` names the collective
    (``"unshard.s0"``).
    """

    step: MetaStep
    op: CollectiveOp
    group: tuple[int, ...]
    key: str
    payload: tuple[HostArray, ...]
    reply: ReplyFuture[tuple[HostArray, ...]] = field(compare=False)


P2PRequest = SendRequest | RecvRequest | CollectiveRequest


class RequestSink(Protocol):
    """Where a rank's requests to its P2P actor go (``ppswap.actors.p2p.P2PChannel``)."""

    def send_nowait(self, request: P2PRequest) -> None: ...

    async def send(self, request: P2PRequest) -> None: ...
