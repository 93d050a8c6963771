"""Completing MPI requests from an event loop without blocking it (``MPITransport``'s).

``InFlightRequests.complete`` polls a message's requests to completion in phases:
tight polling (``Test``) in slices of at most ``busy_poll_s`` with a ``sleep(0)`` between
slices while a spin budget lasts (``spin_s`` plus the payload's time at 1 GB/s), then
single polls between sleeps that double up to ``poll_interval_s``. The tight slices see a
message within about a microsecond of its arrival; spinning keeps a message in flight
off asyncio's 1 ms timer resolution; the sleeps keep a rank that waits for its peer's
compute from burning its core (``docs/mpi.md`` has the measurements).

Requests that must wait are tracked with the buffers MPI reads or writes, so that
``cancel_all`` (the transport's ``close``) can cancel and free them; a wait that is
cancelled or fails cancels its requests, and those MPI cannot finish at once stay
tracked until ``cancel_all``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial

import anyio
from mpi4py import MPI

__all__ = ["InFlightRequests"]

_SPIN_BYTES_PER_S = 1e9
_FIRST_SLEEP_S = 20e-6
_CANCEL_DEADLINE_S = 1.0


@dataclass(slots=True)
class _InFlight:
    """Requests of one message and the buffers MPI reads or writes until they complete."""

    requests: list[MPI.Request]
    buffers: tuple[object, ...]
    p2p_send: bool  # counted by pending_p2p_sends() while pending


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

    def pending_p2p_sends(self) -> int:
        """P2P sends whose requests have not completed."""
        return sum(1 for record in self._pending.values() if record.p2p_send)

    def poll(self, requests: list[MPI.Request], busy_s: float) -> bool:
        """Test ``requests`` in a tight loop for up to ``busy_s``: whether all completed.

        Raises if ``cancel_all()`` ran while they were pending.
        """
        if self.closed:
            raise RuntimeError("MPITransport was closed while a message was in flight")
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

    def cancel_all(self) -> None:
        """Cancel every pending request and free it; set ``closed``. Idempotent.

        Waits at most about a second for the cancelled requests to complete; any left are
        freed (MPI finishes them in the background) so the process can exit.
        """
        if self.closed:
            return
        self.closed = True
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
