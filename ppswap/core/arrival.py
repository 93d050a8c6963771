"""Arrival: a received payload handed straight to the compute thread that waits for it.

When every rank is its own process, the compute thread has nobody to share with, and a
leaf whose input has not arrived yet can wait for it on the thread instead of going back
to the event loop: the batch carries on the moment the payload is there. Without this a
message that lands wakes the transport's thread, then the loop, which hands the next
batch to the compute thread: two thread hand-offs on the pipeline's critical path, each
about 100-200 us on a loaded machine.

An ``Arrival`` is the receive's slot for that. It is landed exactly once, by the first of:

- the transport's own thread, the moment the payload is decoded
  (``LandingTransport.start_recv_landing``);
- the event loop, when the receive's ``ReplyFuture`` resolves with the payload or an error
  (every path that resolves a receive lands its arrival, so a transport that cannot land
  from its thread still wakes the waiter, one hop later);
- ``abandon``, when the run stops while the compute thread waits (cancellation, a missed
  deadline, another actor's failure): the waiter raises and the thread is free.

``wait(timeout_s)`` blocks the calling thread until then and raises ``ArrivalTimeoutError``
after ``timeout_s``, so no wait is without a deadline.
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

__all__ = ["Arrival", "ArrivalTimeoutError", "ThreadWait"]


class ArrivalTimeoutError(TimeoutError):
    """A ``ThreadWait`` (an ``Arrival``, a copy's completion) was not there within the
    wait's deadline."""


class ThreadWait(Protocol):
    """What a compute-thread job waits for before its body runs: ``wait(timeout_s)``
    blocks until it is there (its value, or raises its error; ``ArrivalTimeoutError``
    after ``timeout_s``); ``abandon(reason)``, from any thread, wakes a waiter, which
    raises (the run stopped)."""

    label: str

    def wait(self, timeout_s: float) -> Any: ...
    def abandon(self, reason: str) -> None: ...


class Arrival:
    """A one-shot, thread-safe slot for one received payload (module docstring)."""

    __slots__ = ("_error", "_event", "_lock", "_payload", "label")

    def __init__(self, label: str) -> None:
        self.label = label
        self._lock = threading.Lock()
        self._event = threading.Event()
        self._payload: Any = None
        self._error: BaseException | None = None

    @property
    def landed(self) -> bool:
        return self._event.is_set()

    def land(self, payload: Any, error: BaseException | None = None) -> bool:
        """Any thread: set the payload (or the error) unless landed already; whether
        this call landed it."""
        with self._lock:
            if self._event.is_set():
                return False
            self._payload, self._error = payload, error
            self._event.set()
        return True

    def abandon(self, reason: str) -> None:
        """Land a ``RuntimeError`` saying ``reason`` unless landed already: a thread
        waiting wakes and raises."""
        self.land(None, RuntimeError(f"{self.label}: {reason}"))

    def wait(self, timeout_s: float) -> Any:
        """Block until landed: the payload, or raise the error it landed with;
        ``ArrivalTimeoutError`` after ``timeout_s``."""
        if not self._event.wait(None if timeout_s == float("inf") else timeout_s):
            raise ArrivalTimeoutError(f"{self.label} not received within {timeout_s}s")
        if self._error is not None:
            raise self._error
        return self._payload
