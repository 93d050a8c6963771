"""OneShot: a value set once, by any thread, that threads wait for or are called back on.

The runtime's cross-thread signals are all this shape: a copy's completion
(``backends.base.CopyEvent``), a received payload handed to the compute thread
(``core.arrival.Arrival``), a copy's completion as the compute thread waits for it
(``actors.copy_stream.CopyWait``). Each is set exactly once, by the first of several
threads that may set it (the copy thread, a transport's thread, the event loop, a
cancellation). A thread may block in ``wait(timeout_s)``; the event loop, or a thread
that must not block (``DedicatedThread`` parking a job), registers ``on_set(callback)``
instead. The callbacks run exactly once, on the thread whose ``set_value`` won, after
the value is readable and outside the lock.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["OneShot"]

T = TypeVar("T")


class OneShot(Generic[T]):
    """A one-shot, thread-safe value with callbacks (see the module docstring).

    Built on one lock, as ``threading.Condition`` is, without an ``Event`` and its
    ``Condition``: the runtime makes one per job, receive and copy (thousands per run, on
    the event loop), so its construction is on the hot path. A blocked ``wait`` holds a
    lock of its own, made only then, which ``set_value`` releases.
    """

    __slots__ = ("_callbacks", "_is_set", "_lock", "_value", "_waiters")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._is_set = False
        self._value: T | None = None
        self._callbacks: list[Callable[[], object]] = []
        self._waiters: list[threading.Lock] = []

    def is_set(self) -> bool:
        return self._is_set

    def set_value(self, value: T) -> bool:
        """Set ``value`` unless set already; whether this call set it. The first setter
        wakes the waiting threads, then runs the ``on_set`` callbacks, on its own thread."""
        with self._lock:
            if self._is_set:
                return False
            self._value = value
            self._is_set = True
            callbacks, self._callbacks = self._callbacks, []
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.release()
        for callback in callbacks:
            callback()
        return True

    @property
    def value(self) -> T:
        """The value set (``RuntimeError`` before it is)."""
        if not self._is_set:
            raise RuntimeError("OneShot.value read before the value was set")
        return self._value  # type: ignore[return-value]  # set: a T (None where T is)

    def wait(self, timeout_s: float) -> bool:
        """Block until set or ``timeout_s`` passed (``math.inf``: no limit); whether it
        is set."""
        if self._is_set:
            return True
        with self._lock:
            if self._is_set:
                return True
            waiter = threading.Lock()
            waiter.acquire()
            self._waiters.append(waiter)
        if timeout_s == math.inf:
            waiter.acquire()
            return True
        if waiter.acquire(timeout=min(max(timeout_s, 0.0), threading.TIMEOUT_MAX)):
            return True
        with self._lock:  # timed out: unless set_value took it meanwhile, withdraw
            if waiter in self._waiters:
                self._waiters.remove(waiter)
        return self._is_set

    def on_set(self, callback: Callable[[], object]) -> None:
        """Call ``callback()`` once the value is set: at once (on this thread) if it is,
        else on the thread that sets it."""
        with self._lock:
            if not self._is_set:
                self._callbacks.append(callback)
                return
        callback()
