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
after ``timeout_s``, so no wait is without a deadline. A thread shared by several ranks
does not block: it parks the job and asks ``on_ready(callback)`` to be told when the slot
is landed (``DedicatedThread``'s ``Resume``), then reads it with ``wait(0.0)``.
``FirstOf`` is ready once either of two waits is: a composite's two leaves in a batch
wait for whichever input comes first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from ppswap.core.oneshot import OneShot

__all__ = ["Arrival", "ArrivalTimeoutError", "FirstOf", "ThreadWait"]


class ArrivalTimeoutError(TimeoutError):
    """A ``ThreadWait`` (an ``Arrival``, a copy's completion) was not there within the
    wait's deadline."""


class ThreadWait(Protocol):
    """What a compute-thread job waits for before its body runs: ``wait(timeout_s)``
    blocks until it is there (its value, or raises its error; ``ArrivalTimeoutError``
    after ``timeout_s``); ``abandon(reason)``, from any thread, wakes a waiter, which
    raises (the run stopped); ``on_ready(callback)`` calls ``callback()`` once, when
    ``wait`` would no longer block (at once if it would not now; else on the thread that
    lands or abandons it)."""

    @property
    def label(self) -> str: ...
    @property
    def ready(self) -> bool: ...
    def wait(self, timeout_s: float) -> Any: ...
    def abandon(self, reason: str) -> None: ...
    def on_ready(self, callback: Callable[[], None]) -> None: ...


class Arrival:
    """A one-shot, thread-safe slot for one received payload (module docstring)."""

    __slots__ = ("_landed", "label")

    def __init__(self, label: str) -> None:
        self.label = label
        self._landed: OneShot[tuple[Any, BaseException | None]] = OneShot()

    @property
    def landed(self) -> bool:
        return self._landed.is_set()

    ready = landed

    def land(self, payload: Any, error: BaseException | None = None) -> bool:
        """Any thread: set the payload (or the error) unless landed already; whether
        this call landed it (then the ``on_ready`` callbacks run, on this thread)."""
        return self._landed.set_value((payload, error))

    def on_ready(self, callback: Callable[[], None]) -> None:
        self._landed.on_set(callback)

    def abandon(self, reason: str) -> None:
        """Land a ``RuntimeError`` saying ``reason`` unless landed already: a thread
        waiting wakes and raises."""
        self.land(None, RuntimeError(f"{self.label}: {reason}"))

    def wait(self, timeout_s: float) -> Any:
        """Block until landed: the payload, or raise the error it landed with;
        ``ArrivalTimeoutError`` after ``timeout_s`` (``math.inf``: no limit)."""
        if not self._landed.wait(timeout_s):
            raise ArrivalTimeoutError(f"{self.label} not received within {timeout_s}s")
        payload, error = self._landed.value
        if error is not None:
            raise error
        return payload


class FirstOf:
    """A ``ThreadWait`` that is ready once either of two is: what a batch waits for
    before two jobs that may run in either order (the leaves of a composite), so the one
    whose input comes first runs first. ``wait`` returns None (read each wait itself);
    ``abandon`` abandons both."""

    __slots__ = ("_either", "first", "second")

    def __init__(self, first: ThreadWait, second: ThreadWait) -> None:
        self.first, self.second = first, second
        self._either: OneShot[None] = OneShot()
        first.on_ready(self._fire)
        second.on_ready(self._fire)

    def _fire(self) -> None:
        self._either.set_value(None)

    @property
    def label(self) -> str:
        return f"{self.first.label} or {self.second.label}"

    @property
    def ready(self) -> bool:
        return self._either.is_set()

    def wait(self, timeout_s: float) -> None:
        if not self._either.wait(timeout_s):
            raise ArrivalTimeoutError(
                f"neither {self.first.label} nor {self.second.label} within {timeout_s}s"
            )

    def abandon(self, reason: str) -> None:
        self.first.abandon(reason)
        self.second.abandon(reason)

    def on_ready(self, callback: Callable[[], None]) -> None:
        self._either.on_set(callback)
