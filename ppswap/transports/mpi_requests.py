"""Completing MPI requests from an event loop without blocking it (``MPITransport``'s).

``InFlightRequests.complete`` polls a message's requests to completion in phases:
tight polling (``Test``) in slices of at most ``busy_poll_s`` with a ``sleep(0)`` between
slices while a spin budget lasts (``spin_s`` plus the payload's time at 1 GB/s), then
single polls between sleeps that double up to ``poll_interval_s``. The tight slices see a
message within about a microsecond of its arrival; spinning keeps a message in flight
off asyncio's 1 ms timer resolution; the sleeps keep a rank that waits for its peer's
compute from burning its core (``docs/mpi.md`` has the measurements).

``InFlightRequests.start`` is the same without a task per message (the P2P actor's path,
``MPITransport.start_send`` / ``start_recv``): the requests are tested once, and if they
must wait, one poller for all of them, a loop callback, tests every started message per
poll and calls back each one that completed. It has the same phases, shared: a started
message extends the spin budget, and while it lasts the poller spins in slices of at most
``busy_poll_s`` with a loop iteration (``call_soon``) between them; then it polls after
doubling intervals up to ``poll_interval_s`` (``call_later``). So several messages in
flight cost one spin, not one each.

Requests that must wait are tracked with the buffers MPI reads or writes, so that
``cancel_all`` (the transport's ``close``) can cancel and free them; a wait that is
cancelled or fails (or a started message that is cancelled) cancels its requests, and
those MPI cannot finish at once stay tracked until ``cancel_all``, which also fails every
started message's callback with ``RuntimeError``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
from mpi4py import MPI

from ppswap.core.transport import FINISHED, RecvDone, Started, call_back
from ppswap.core.wire import HEADER_MAX_BYTES, INLINE_MAX_BYTES, RecvBufferPool, decode_header

__all__ = ["FIRST_BYTES", "Done", "InFlightRequests", "StartedRecv"]

Array = npt.NDArray[Any]
FIRST_BYTES = HEADER_MAX_BYTES + INLINE_MAX_BYTES  # the header message, inline payload included

Done = Callable[[BaseException | None], None]
"""Called back on the loop once a started message's requests completed (or failed)."""

_SPIN_BYTES_PER_S = 1e9
_FIRST_SLEEP_S = 20e-6
_CANCEL_DEADLINE_S = 1.0
_CLOSED = "MPITransport was closed while a message was in flight"


@dataclass(slots=True)
class _InFlight:
    """Requests of one message and the buffers MPI reads or writes until they complete."""

    requests: list[MPI.Request]
    buffers: tuple[object, ...]
    p2p_send: bool  # counted by pending_p2p_sends() while pending


@dataclass(slots=True, eq=False)
class _Started(_InFlight):
    """A started message (``InFlightRequests.start``): called back once, or cancelled."""

    owner: InFlightRequests | None = None
    on_done: Done | None = None
    error: BaseException | None = None

    def cancel(self) -> None:
        """Its callback will not run; its requests are cancelled (see the module doc)."""
        if self.on_done is not None and self.owner is not None:
            self.owner.cancel_started(self)


class InFlightRequests:
    """The MPI requests of one transport that have not completed yet, and how to wait.

    Used from one thread (the event loop's). ``closed`` turns true in ``cancel_all``;
    a wait still running then raises ``RuntimeError``.
    """

    def __init__(self, *, poll_interval_s: float, spin_s: float, busy_poll_s: float) -> None:
        self.poll_interval_s = poll_interval_s
        self.spin_s = spin_s
        self.busy_poll_s = busy_poll_s
        self.closed = False
        self._pending: dict[int, _InFlight] = {}
        self._started: dict[int, _Started] = {}  # polled by _poll, in start order
        self._poller: asyncio.Handle | None = None
        self._spin_until = 0.0
        self._delay = _FIRST_SLEEP_S

    def pending_p2p_sends(self) -> int:
        """P2P sends whose requests have not completed."""
        return sum(1 for record in self._pending.values() if record.p2p_send)

    def poll(self, requests: list[MPI.Request], busy_s: float) -> bool:
        """Test ``requests`` in a tight loop for up to ``busy_s``: whether all completed.

        Raises if ``cancel_all()`` ran while they were pending.
        """
        if self.closed:
            raise RuntimeError(_CLOSED)
        # one request: Request.Test (0.4 us) instead of Testall over a list (1 us), so a
        # tight loop sees the completion sooner
        test = requests[0].Test if len(requests) == 1 else partial(MPI.Request.Testall, requests)
        busy_until = time.perf_counter() + busy_s
        while not test():
            if time.perf_counter() >= busy_until:
                return False
        return True

    async def complete(
        self, requests: list[MPI.Request], buffers: tuple[object, ...], p2p_send: bool, nbytes: int
    ) -> None:
        """Poll ``requests`` to completion, blocking the loop ``busy_poll_s`` at most at a time.

        ``buffers`` are what MPI reads or writes until they complete; ``p2p_send`` marks a
        P2P send; ``nbytes`` sizes the spin budget. See the module doc for the phases and
        for what a cancelled wait leaves behind.
        """
        if self.poll(requests, self.busy_poll_s):
            return
        record = _InFlight(requests, buffers, p2p_send)
        self._pending[id(record)] = record
        done = False
        try:
            spin_until = time.perf_counter() + self.spin_s + nbytes / _SPIN_BYTES_PER_S
            delay = _FIRST_SLEEP_S
            while True:
                if time.perf_counter() < spin_until:
                    await anyio.sleep(0)
                    if self.poll(requests, self.busy_poll_s):
                        break
                else:
                    await anyio.sleep(min(delay, self.poll_interval_s))
                    delay *= 2
                    if self.poll(requests, 0.0):
                        break
            done = True
        finally:
            if done:
                del self._pending[id(record)]
            elif not self.closed:
                for request in requests:
                    if request != MPI.REQUEST_NULL:
                        request.Cancel()
                if MPI.Request.Testall(requests):
                    del self._pending[id(record)]

    def start(
        self,
        requests: list[MPI.Request],
        buffers: tuple[object, ...],
        p2p_send: bool,
        nbytes: int,
        on_done: Done,
    ) -> Started:
        """``complete`` without a task: ``on_done`` gets ``None`` (or the error) on the loop
        once ``requests`` completed; at once if they already have (before this returns).

        Raises ``RuntimeError`` if ``cancel_all()`` ran. See the module doc for the polls.
        """
        if self.closed:
            raise RuntimeError("MPITransport is closed")
        if requests[0].Test() if len(requests) == 1 else MPI.Request.Testall(requests):
            on_done(None)
            return FINISHED
        record = _Started(requests, buffers, p2p_send, self, on_done)
        self._pending[id(record)] = record
        self._started[id(record)] = record
        now = time.perf_counter()
        self._spin_until = max(self._spin_until, now + self.spin_s + nbytes / _SPIN_BYTES_PER_S)
        self._delay = _FIRST_SLEEP_S
        if self._poller is None or isinstance(self._poller, asyncio.TimerHandle):
            if self._poller is not None:  # asleep between polls: spin for this one now
                self._poller.cancel()
            self._poller = asyncio.get_running_loop().call_soon(self._poll)
        return record

    def cancel_started(self, record: _Started) -> None:
        """Cancel a started message: no callback; its requests cancelled in MPI."""
        record.on_done = None
        self._started.pop(id(record), None)
        if not self._started and self._poller is not None:
            self._poller.cancel()
            self._poller = None
        if self.closed:
            return
        for request in record.requests:
            if request != MPI.REQUEST_NULL:
                request.Cancel()
        if MPI.Request.Testall(record.requests):
            self._pending.pop(id(record), None)

    def _poll(self) -> None:
        """Test every started message, call back those that completed, poll again later."""
        self._poller = None
        if self.closed:
            return
        now = time.perf_counter()
        spinning = now < self._spin_until
        busy_until = now + (self.busy_poll_s if spinning else 0.0)
        while True:
            ended = [r for r in self._started.values() if _ended(r)]
            if ended or time.perf_counter() >= busy_until:
                break
        for record in ended:
            del self._started[id(record)]
            self._pending.pop(id(record), None)
        if self._started and not self.closed:
            loop = asyncio.get_running_loop()
            if spinning:
                self._poller = loop.call_soon(self._poll)
            else:
                if ended:
                    self._delay = _FIRST_SLEEP_S
                self._poller = loop.call_later(min(self._delay, self.poll_interval_s), self._poll)
                self._delay *= 2
        for record in ended:
            on_done, record.on_done = record.on_done, None
            if on_done is not None:  # not cancelled by an earlier callback of this poll
                call_back(on_done, record.error)

    def cancel_all(self) -> None:
        """Cancel every pending request and free it; set ``closed``; fail every started
        message's callback (``RuntimeError``). Idempotent.

        Waits at most about a second for the cancelled requests to complete; any left are
        freed (MPI finishes them in the background) so the process can exit.
        """
        if self.closed:
            return
        self.closed = True
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None
        started = list(self._started.values())
        self._started.clear()
        records = list(self._pending.values())
        self._pending.clear()
        requests = [r for record in records for r in record.requests if r != MPI.REQUEST_NULL]
        for request in requests:
            request.Cancel()
        deadline = time.monotonic() + _CANCEL_DEADLINE_S
        while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
            time.sleep(1e-4)
        for request in requests:
            if request != MPI.REQUEST_NULL:
                request.Free()
        for record in started:
            on_done, record.on_done = record.on_done, None
            if on_done is not None:
                on_done(RuntimeError(_CLOSED))  # the caller of close() sees what raises


def _ended(record: _Started) -> bool:
    """Whether the record's requests completed (or failed: then ``record.error`` is set)."""
    requests = record.requests
    try:
        return requests[0].Test() if len(requests) == 1 else MPI.Request.Testall(requests)
    except Exception as exc:  # an MPI error (with MPI.ERRORS_RETURN)
        record.error = exc
        return True


class StartedRecv:
    """A started receive of one message (``MPITransport.start_recv``): the header's
    request, then, for a payload that does not travel inside the header, the body's
    (``MPITransport._recv_message`` is the awaitable form); then ``on_done``.

    ``header`` is ``(epoch, identity)`` to check; ``buffers`` are the transport's free
    header buffers and its pool for bodies.
    """

    __slots__ = (
        "_buffers",
        "_comm",
        "_current",
        "_first",
        "_header",
        "_on_done",
        "_requests",
        "_src",
        "_tag",
        "_what",
    )

    def __init__(
        self,
        requests: InFlightRequests,
        comm: MPI.Comm,
        src: int,
        tag: int,
        header: tuple[int, int],
        what: tuple[object, ...],
        buffers: tuple[list[bytearray], RecvBufferPool],
        on_done: RecvDone,
    ) -> None:
        self._requests, self._comm, self._src, self._tag = requests, comm, src, tag
        self._header, self._what, self._buffers = header, what, buffers
        self._on_done: RecvDone | None = on_done
        free = buffers[0]
        # header buffers are reused: a fresh 16 KiB allocation per message cost 1-2 us
        self._first = first = free.pop() if free else bytearray(FIRST_BYTES)
        self._current: Started | None = None  # set by a phase that did not end at once
        started = requests.start([comm.Irecv(first, src, tag)], (first,), False, 0, self._header_in)
        if self._current is None:
            self._current = started

    def cancel(self) -> None:
        """No callback; the current phase's request is cancelled in MPI."""
        self._on_done = None
        if self._current is not None:
            self._current.cancel()

    def _header_in(self, error: BaseException | None) -> None:
        if error is not None:
            self._finish(None, error)
            return
        first = self._first
        try:
            found = decode_header(first, *self._header, self._what)
        except Exception as exc:
            self._finish(None, exc)
            return
        nbytes, dtype, shape, size, page_offset = found
        free, pool = self._buffers
        if nbytes <= INLINE_MAX_BYTES:
            inline = np.frombuffer(first[size : size + nbytes], dtype=np.uint8)  # a copy
            free.append(first)
            self._finish(np.ndarray(shape, dtype, inline), None)
            return
        free.append(first)
        raw = pool.take(nbytes, page_offset)  # lies in its page as the sender's
        request = self._comm.Irecv(raw, self._src, self._tag + 1)
        self._current = None
        done = partial(self._body_in, np.ndarray(shape, dtype, raw))
        started = self._requests.start([request], (raw,), False, nbytes, done)
        if self._current is None:
            self._current = started

    def _body_in(self, array: Array, error: BaseException | None) -> None:
        self._finish(array if error is None else None, error)

    def _finish(self, array: Array | None, error: BaseException | None) -> None:
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            on_done(array, error)
