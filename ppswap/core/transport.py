"""The transport protocols: how a rank's messages and collectives reach other ranks.

``Transport`` moves host arrays between ranks (``send`` / ``recv``, awaited concurrently);
``CollectiveTransport`` is the collective side FSDP needs (``all_gather``,
``reduce_scatter_sum``); ``AllToAllTransport`` adds the all-to-all with variable splits
expert parallelism needs; ``ImmediateTransport`` matches messages on the spot (every rank in
this event loop); ``CallbackTransport`` starts a send or a receive and calls back on the
event loop when it completes (the multi-process transports: the P2P actor serves them
without a task per message); ``LandingTransport`` also hands a received payload over on
its own thread (to a compute thread waiting for it, ``core.arrival``);
``MultiProcessTransport`` has one process per rank, and
``DistributedTransport`` is one the runtime configures per run and gathers results
over. Implementations: ``ppswap.actors.p2p.InProcessTransport`` (the default),
``ppswap.transports.mpi.MPITransport``,
``ppswap.backends.torch.distributed.TorchDistTransport``.
A message is identified by ``(src, dst, MessageKey)``, unique within a run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol, TypeAlias, TypeGuard, runtime_checkable

from ppswap.core.dtypes import BFLOAT16, is_bfloat16
from ppswap.core.messages import HostArray, MessageKey
from ppswap.core.protocols import conforms

__all__ = [
    "FINISHED",
    "AllToAllTransport",
    "CallbackTransport",
    "CollectiveTransport",
    "DistributedTransport",
    "ImmediateTransport",
    "LandingTransport",
    "MultiProcessTransport",
    "RecvDone",
    "SendDone",
    "Started",
    "Transport",
    "TransportStats",
    "call_back",
    "check_all_to_all",
    "complete_all",
    "is_all_to_all",
    "is_callback",
    "is_collective",
    "is_distributed",
    "is_immediate",
    "is_landing",
    "is_multi_process",
    "is_transport",
    "sum_contributions",
]

SendDone: TypeAlias = Callable[[BaseException | None], None]
"""Called back when a started send completed: ``None``, or the error it failed with."""
RecvDone: TypeAlias = Callable[[HostArray | None, BaseException | None], None]
"""Called back when a started receive completed: ``(payload, None)`` or ``(None, error)``."""


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
class AllToAllTransport(Protocol):
    """The all-to-all of expert parallelism, for the calling rank: ``arrays[j]`` goes to
    ``group[j]``, any number of rows each (zero included; the splits vary per call);
    returns what every member sent to ``rank``, in ``group`` order. Every member passes
    the same ``group`` and ``key`` and makes the same calls in the same order; rows must
    agree in trailing shape and dtype (``check_all_to_all``)."""

    async def all_to_all(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[HostArray]
    ) -> list[HostArray]: ...


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


class Started(Protocol):
    """A send or receive started by a ``CallbackTransport``, until it calls back."""

    def cancel(self) -> None:
        """Stop it: its callback will not run. Withdraws the operation where the transport
        can (MPI cancels its requests; a posted gloo operation stays posted, as after a
        cancelled ``recv``). Idempotent; does nothing once the callback ran."""
        ...


class _Finished:
    """The handle of an operation that completed before ``start_*`` returned."""

    __slots__ = ()

    def cancel(self) -> None:
        return None


FINISHED: Started = _Finished()


@runtime_checkable
class CallbackTransport(Protocol):
    """A transport that starts a send or a receive and calls back when it completes.

    The P2P actor serves such a transport without a task per message. ``start_send`` /
    ``start_recv`` are called on the event loop's thread, as ``send`` / ``recv`` are
    awaited there, and have their semantics (a send completes once its buffer may be
    reused). A bad argument or a closed transport raises at once (nothing started);
    otherwise ``on_done`` runs exactly once on the event loop's thread, with the result or
    the error (``close()`` fails every started operation with ``RuntimeError``), unless
    the returned handle was cancelled first. It may run before ``start_*`` returns (an
    operation that completed at once). ``starts_messages`` is False where this instance
    can only be awaited (``send`` / ``recv``).
    """

    @property
    def starts_messages(self) -> bool: ...

    def start_send(
        self, src: int, dst: int, key: MessageKey, payload: HostArray, on_done: SendDone
    ) -> Started: ...

    def start_recv(self, dst: int, src: int, key: MessageKey, on_done: RecvDone) -> Started: ...


@runtime_checkable
class LandingTransport(CallbackTransport, Protocol):
    """A ``CallbackTransport`` whose receives complete on threads of its own, which hand
    the payload over right there: ``start_recv_landing`` is ``start_recv`` that also calls
    ``on_landed(payload)`` on that thread the moment the payload is decoded, before
    ``on_done`` runs on the loop with the same payload (not for a failure: that goes to
    ``on_done`` only). ``on_landed`` must be thread-safe and must not block.
    """

    def start_recv_landing(
        self,
        dst: int,
        src: int,
        key: MessageKey,
        on_done: RecvDone,
        on_landed: Callable[[HostArray], object],
    ) -> Started: ...


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


def call_back(on_done: Callable[..., None], *result: object) -> None:
    """Call a started operation's callback with ``result``; should it raise, the error goes
    to the event loop's exception handler, so that a transport calling back several
    operations at once calls back the others too."""
    try:
        on_done(*result)
    except Exception as exc:
        asyncio.get_running_loop().call_exception_handler(
            {"message": f"a transport's callback {on_done!r} raised", "exception": exc}
        )


async def complete_all(
    starts: Sequence[Callable[[Callable[..., None]], Started]],
) -> list[Any]:
    """Start every operation and wait until each one called back: what each one got, in
    order (``None`` for a send). Each start is called with its callback (a send's gets
    ``(error)``, a receive's ``(payload, error)``). The first error is raised and the
    other operations cancelled; so are all of them when the wait is cancelled.

    A transport's collectives use it: the messages of one call without a task each.
    """
    if not starts:
        return []
    future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    results: list[Any] = [None] * len(starts)
    left = len(starts)

    def done(index: int, *result: Any) -> None:
        nonlocal left
        if future.done():
            return
        if result[-1] is not None:
            future.set_exception(result[-1])
            return
        results[index] = result[0] if len(result) == 2 else None
        left -= 1
        if left == 0:
            future.set_result(None)

    handles: list[Started] = []
    try:
        for index, start in enumerate(starts):
            handles.append(start(partial(done, index)))
        await future
    finally:
        for handle in handles:
            handle.cancel()  # nothing for those that called back
    return results


def sum_contributions(
    key: str, group: tuple[int, ...], rank: int, parts: Sequence[HostArray]
) -> HostArray:
    """``reduce_scatter_sum``'s result for ``rank`` from every member's contribution to it
    (``parts[j]`` from ``group[j]``): a left fold in group order (``p_0 + p_1 + ...``, in a
    new array), so that every transport gives the same bits on every run. A contribution
    whose shape or dtype differs from this rank's own is a ValueError naming its sender.

    bfloat16 parts are summed as ``ml_dtypes``' whatever numpy type carries them (the wire
    delivers that one; MindSpore's own is another): the result is this rank's type."""
    own = parts[group.index(rank)].dtype
    carried = BFLOAT16 is not None and is_bfloat16(own)
    if carried:
        parts = [p.view(BFLOAT16) if is_bfloat16(p.dtype) else p for p in parts]
    mine = parts[group.index(rank)]
    for member, part in zip(group, parts, strict=True):
        if part.shape != mine.shape or part.dtype != mine.dtype:
            raise ValueError(
                f"reduce_scatter_sum {key!r}: rank {member} sent {part.shape} "
                f"{part.dtype}, rank {rank} expects {mine.shape} {mine.dtype}"
            )
    total = parts[0].copy()
    for part in parts[1:]:
        total += part
    return total.view(own) if carried else total


def check_all_to_all(
    key: str,
    group: tuple[int, ...],
    rank: int,
    own: HostArray,
    parts: Sequence[HostArray],
) -> list[HostArray]:
    """``all_to_all``'s result for ``rank`` (``parts[j]`` from ``group[j]``), checked:
    every part must have the trailing shape and dtype of ``own`` (what this rank sent to
    itself), else a ValueError naming the sender. Returns ``list(parts)``."""
    for member, part in zip(group, parts, strict=True):
        if part.shape[1:] != own.shape[1:] or part.dtype != own.dtype or part.ndim != own.ndim:
            raise ValueError(
                f"all_to_all {key!r}: rank {member} sent rows of {part.shape[1:]} "
                f"{part.dtype}, rank {rank} expects rows of {own.shape[1:]} {own.dtype}"
            )
    return list(parts)


# -- the checks, answered once per class (``ppswap.core.protocols``) ----------------------


def is_transport(value: object) -> TypeGuard[Transport]:
    return conforms(value, Transport)


def is_collective(value: object) -> TypeGuard[CollectiveTransport]:
    return conforms(value, CollectiveTransport)


def is_all_to_all(value: object) -> TypeGuard[AllToAllTransport]:
    return conforms(value, AllToAllTransport)


def is_immediate(value: object) -> TypeGuard[ImmediateTransport]:
    return conforms(value, ImmediateTransport)


def is_callback(value: object) -> TypeGuard[CallbackTransport]:
    return conforms(value, CallbackTransport)


def is_landing(value: object) -> TypeGuard[LandingTransport]:
    return conforms(value, LandingTransport)


def is_multi_process(value: object) -> TypeGuard[MultiProcessTransport]:
    return conforms(value, MultiProcessTransport)


def is_distributed(value: object) -> TypeGuard[DistributedTransport]:
    return conforms(value, DistributedTransport)
