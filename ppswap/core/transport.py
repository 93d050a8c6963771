"""The transport protocols: how a rank's messages and collectives reach other ranks.

Each protocol says what one kind of caller needs, and a caller types against the narrowest
one (as anyio's memory streams, every method states when it blocks and what it raises):

- ``PointToPoint``: ``send`` / ``recv`` of host arrays, awaited concurrently (the P2P
  actor's task path: with a fault plan, or a transport with neither of the next two);
  ``Transport`` adds ``stats`` and is what a run takes (``RunOptions.transport``).
- ``ImmediateTransport``: matches messages on the spot (every rank in this event loop);
  ``CallbackTransport``: starts a send or a receive and calls back on the loop when it
  completes (the multi-process transports: the P2P actor serves them without a task per
  message); ``LandingTransport`` also hands a received payload over on its own thread (to
  a compute thread waiting for it, ``core.arrival``).
- ``AllGatherTransport``: ``all_gather``, what every multi-process run uses (the results,
  the tie declarations, ``gather_full_gradients``); ``CollectiveTransport`` adds
  ``reduce_scatter_sum`` (FSDP); ``AllToAllTransport``: the all-to-all with variable
  splits (expert parallelism).
- ``MultiProcessTransport``: one process per rank (``rank``, ``world_size``);
  ``RunConfigured``: ``configure`` before each run; ``DistributedTransport`` is the three
  a run across processes needs together (multi-process, configured, all-gather).

Where a run needs a part the transport lacks, it is refused before it starts, naming the
part (``planning.prepare``: a run in one process takes the in-process transport or a
multi-process one; ``fsdp.plan``: FSDP across processes needs collectives and
``configure``, expert parallelism the all-to-all; ``planning.ties``: declared ties across
processes need a ``DistributedTransport``). Implementations:
``ppswap.transports.inprocess.InProcessTransport`` (the default),
``ppswap.transports.mpi.MPITransport``,
``ppswap.backends.torch.distributed.TorchDistTransport``.
A message is identified by ``(src, dst, MessageKey)``, unique within a run. The protocols
promise no deadline: the caller bounds every wait (the step deadline), whatever bound a
transport has of its own (``TorchDistTransport``'s ``timeout_s``).
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
    "AllGatherTransport",
    "AllToAllTransport",
    "CallbackTransport",
    "CollectiveTransport",
    "DistributedTransport",
    "ImmediateTransport",
    "LandingTransport",
    "MultiProcessTransport",
    "PointToPoint",
    "RecvDone",
    "RunConfigured",
    "SendDone",
    "Started",
    "Transport",
    "TransportStats",
    "call_back",
    "check_all_to_all",
    "complete_all",
    "is_all_gather",
    "is_all_to_all",
    "is_callback",
    "is_collective",
    "is_distributed",
    "is_immediate",
    "is_landing",
    "is_multi_process",
    "is_run_configured",
    "is_transport",
    "sum_contributions",
]

SendDone: TypeAlias = Callable[[BaseException | None], None]
"""Called back when a started send completed: ``None``, or the error it failed with."""
RecvDone: TypeAlias = Callable[[HostArray | None, BaseException | None], None]
"""Called back when a started receive completed: ``(payload, None)`` or ``(None, error)``."""


@dataclass(frozen=True, slots=True)
class TransportStats:
    """Counts of one rank's P2P messages; ``undelivered``: sends not yet completed (or,
    in one process, messages no receiver took)."""

    messages_sent: int
    messages_received: int
    bytes_sent: int
    undelivered: int


@runtime_checkable
class PointToPoint(Protocol):
    """Sends and receives of host arrays between ranks. A send and a receive may be
    awaited concurrently, and never wait for each other."""

    async def send(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None:
        """Send ``payload`` as message ``key`` from this rank ``src`` to rank ``dst``.

        Blocks until the payload's buffer may be reused, not until it is received (the
        in-process transport buffers it: it never blocks). Raises TypeError or ValueError
        naming the argument (``src`` not this process's rank, ``dst`` not a rank, a
        payload the wire cannot carry) and RuntimeError when the transport is closed or
        ``key`` was sent to ``dst`` already; a failed send raises the library's error.
        """
        ...

    async def recv(self, dst: int, src: int, key: MessageKey) -> HostArray:
        """Wait for message ``key`` from rank ``src`` to this rank ``dst``; its payload.

        Blocks until the message is there (across processes the payload is a new array;
        in one process the sender's own). Raises as ``send`` for bad arguments, and
        RuntimeError when the transport is closed, ``key`` is received twice or the
        message fails the wire's checks (another run's epoch, a corrupt header).
        """
        ...


@runtime_checkable
class Transport(PointToPoint, Protocol):
    """What a run takes: point to point, and counts for its flight recorder."""

    def stats(self) -> TransportStats:
        """This rank's message counts so far. Never blocks, never raises."""
        ...


@runtime_checkable
class AllGatherTransport(Protocol):
    """The all-gather over a group of ranks, for the calling rank. Every member passes
    the same ``group`` tuple and ``key`` and makes the same calls in the same order (the
    n-th call with a ``(group, key)`` meets every member's n-th)."""

    async def all_gather(
        self, rank: int, group: tuple[int, ...], key: str, array: HostArray
    ) -> list[HostArray]:
        """Every member's ``array``, in ``group`` order (``rank`` is the caller, its entry
        its own ``array``); arrays may differ in shape and dtype between members.

        Blocks until every member made the call. Raises TypeError or ValueError naming
        the argument (``rank`` not the caller, ``group`` not a tuple of distinct ranks
        holding it, ``array`` not an array the wire carries) and RuntimeError when the
        transport is closed or the members disagree on the group's order.
        """
        ...


@runtime_checkable
class CollectiveTransport(AllGatherTransport, Protocol):
    """FSDP's collectives: the all-gather of ``AllGatherTransport`` and a reduce-scatter."""

    async def reduce_scatter_sum(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[HostArray]
    ) -> HostArray:
        """The sum over members of what they sent to ``rank`` (``arrays[j]`` goes to
        ``group[j]``), a left fold in ``group`` order in a new array, so every run gives
        the same bits (``sum_contributions``).

        Blocks as ``all_gather``. Raises as ``all_gather``, and ValueError when
        ``arrays`` does not hold one array per member or a member's contribution differs
        from the caller's own in shape or dtype (naming that member).
        """
        ...


@runtime_checkable
class AllToAllTransport(Protocol):
    """The all-to-all of expert parallelism, for the calling rank; every member passes
    the same ``group`` and ``key`` and makes the same calls in the same order."""

    async def all_to_all(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[HostArray]
    ) -> list[HostArray]:
        """What every member sent to ``rank``, in ``group`` order: ``arrays[j]`` goes to
        ``group[j]``, any number of rows each (zero included; the splits vary per call).

        Blocks as ``all_gather``. Raises as ``all_gather``, and ValueError when ``arrays``
        does not hold one array per member or a member's rows differ from the caller's
        in trailing shape or dtype (naming that member, ``check_all_to_all``).
        """
        ...


@runtime_checkable
class ImmediateTransport(Protocol):
    """A transport that matches messages on the spot (all ranks in this event loop).
    Both calls run on the loop's thread and never block."""

    def deliver(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None:
        """Hand ``payload`` over: to the ``on_arrival`` expecting it, at once, else it
        waits for its receiver. RuntimeError when ``key`` was sent to ``dst`` already."""
        ...

    def expect(
        self, dst: int, src: int, key: MessageKey, on_arrival: Callable[[HostArray], None]
    ) -> None:
        """Call ``on_arrival(payload)`` on the loop once message ``key`` is there (at once
        if it already is). RuntimeError when ``key`` is expected or received twice."""
        ...


class Started(Protocol):
    """A send or receive started by a ``CallbackTransport``, until it calls back."""

    def cancel(self) -> None:
        """Stop it: its callback will not run. Withdraws the operation where the transport
        can (MPI cancels its requests; a posted gloo operation stays posted, as after a
        cancelled ``recv``). Idempotent; does nothing once the callback ran. Never blocks."""
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
    ``start_recv`` are called on the event loop's thread, never block, and have the
    semantics of ``PointToPoint``'s ``send`` / ``recv`` (a send completes once its buffer
    may be reused). A bad argument or a closed transport raises at once, as ``send`` /
    ``recv`` would (nothing started); otherwise ``on_done`` runs exactly once on the
    event loop's thread, with the result or the error (``close()`` fails every started
    operation with ``RuntimeError``), unless the returned handle was cancelled first. It
    may run before ``start_*`` returns (an operation that completed at once).
    """

    @property
    def starts_messages(self) -> bool:
        """False where this instance can only be awaited (``send`` / ``recv``)."""
        ...

    def start_send(
        self, src: int, dst: int, key: MessageKey, payload: HostArray, on_done: SendDone
    ) -> Started:
        """Start ``send``; ``on_done(None)`` or ``on_done(error)`` when it completes."""
        ...

    def start_recv(self, dst: int, src: int, key: MessageKey, on_done: RecvDone) -> Started:
        """Start ``recv``; ``on_done(payload, None)`` or ``on_done(None, error)``."""
        ...


@runtime_checkable
class LandingTransport(CallbackTransport, Protocol):
    """A ``CallbackTransport`` whose receives complete on threads of its own, which hand
    the payload over right there."""

    def start_recv_landing(
        self,
        dst: int,
        src: int,
        key: MessageKey,
        on_done: RecvDone,
        on_landed: Callable[[HostArray], object],
    ) -> Started:
        """``start_recv`` that also calls ``on_landed(payload)`` on the transport's thread
        the moment the payload is decoded, before ``on_done`` runs on the loop with the
        same payload (a failure goes to ``on_done`` only). ``on_landed`` must be
        thread-safe and must not block."""
        ...


@runtime_checkable
class MultiProcessTransport(Protocol):
    """A transport whose ranks are separate processes. Neither property changes."""

    @property
    def rank(self) -> int:
        """This process's rank."""
        ...

    @property
    def world_size(self) -> int:
        """The number of ranks (processes)."""
        ...


@runtime_checkable
class RunConfigured(Protocol):
    """A transport the runtime configures before each run."""

    def configure(self, num_stages: int, micro_count: int) -> None:
        """The run's P2P tag layout and a new epoch (a message of an earlier run is then
        an error, never a wrong tensor). Every rank calls it with the same values before
        the run's first message. Never blocks; ValueError when the run needs more tags
        than the library has."""
        ...


@runtime_checkable
class DistributedTransport(MultiProcessTransport, RunConfigured, AllGatherTransport, Protocol):
    """What a run across processes needs of its transport, together: one process per
    rank, configured per run, and the all-gather its results and tie declarations go
    through (``MPITransport``, ``TorchDistTransport``)."""


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


def is_all_gather(value: object) -> TypeGuard[AllGatherTransport]:
    return conforms(value, AllGatherTransport)


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


def is_run_configured(value: object) -> TypeGuard[RunConfigured]:
    return conforms(value, RunConfigured)


def is_distributed(value: object) -> TypeGuard[DistributedTransport]:
    return conforms(value, DistributedTransport)
