"""Fiber: a job body that can give its thread up in the middle and go on later.

A MoE block waits for its all-to-alls *inside* a forward or backward. A rank alone in its
process simply blocks its compute thread there (nobody else needs it). Ranks of one
process share the compute thread, and the peer a rank exchanges tokens with runs its
forward on that same thread: blocking would wait forever. So there the body runs as a
``Fiber``: on a thread of its own, but only while the compute thread waits for it, so
that exactly one of the two runs framework code at any moment (a baton, as with a
coroutine). ``step()`` (compute thread) runs the body until it returns (its result; its
error is raised) or calls ``suspend(wait)`` (on its thread): then ``step()`` returns
``Suspended(wait)``, the compute thread parks the job until ``wait`` is ready
(``DedicatedThread``'s ``Resume``) and serves other ranks meanwhile, and the next
``step()`` resumes the body where it stopped.

A fiber's thread is never a daemon: it ends when the body does. ``abandon()`` (any
thread; the run stopped) makes a suspended body raise at once, and ``suspend`` itself
raises after ``timeout_s`` without being resumed, so no fiber thread outlives its run
by more than that. Torch's autograd accepts calls from any thread; MindSpore's PyNative
autograd does not, and two of its recorded forwards cannot interleave: a fiber is for
torch stages.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ppswap.core.arrival import ThreadWait

__all__ = ["Fiber", "FiberAbandonedError", "Suspended"]


class FiberAbandonedError(RuntimeError):
    """A suspended fiber was abandoned (the run stopped) or not resumed in time."""


@dataclass(frozen=True, slots=True)
class Suspended:
    """What ``Fiber.step`` returns when the body gave the thread up until ``wait``."""

    wait: ThreadWait


class Fiber:
    """Runs ``body()`` in steps on a thread of its own (module docstring)."""

    def __init__(self, body: Callable[[], Any], name: str, timeout_s: float = math.inf) -> None:
        self._body = body
        self._name = name
        self._timeout = None if timeout_s == math.inf else timeout_s
        self._resume = threading.Semaphore(0)
        self._yielded = threading.Semaphore(0)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._wait: ThreadWait | None = None
        self._done = False
        self._abandoned = False
        self._result: Any = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        return self._done

    def step(self) -> Any:
        """Caller's thread: run the body until it returns (its result), raises, or
        suspends (``Suspended``); the caller waits meanwhile."""
        if self._done:
            raise RuntimeError(f"fiber {self._name!r} has finished")
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self._name, daemon=False)
            self._thread.start()
        else:
            self._resume.release()
        self._yielded.acquire()
        if not self._done:
            assert self._wait is not None
            return Suspended(self._wait)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def suspend(self, wait: ThreadWait) -> None:
        """The fiber's thread: give the thread back until the caller's next ``step``."""
        with self._lock:
            if self._abandoned:
                raise FiberAbandonedError(f"fiber {self._name!r} was abandoned")
            self._wait = wait
        self._yielded.release()
        resumed = self._resume.acquire(timeout=self._timeout)
        with self._lock:
            if self._abandoned or not resumed:
                self._abandoned = True
                raise FiberAbandonedError(
                    f"fiber {self._name!r} was abandoned while it waited for {wait.label}"
                )

    def abandon(self) -> None:
        """Any thread: make the body raise at its next (or current) ``suspend``."""
        with self._lock:
            if self._abandoned or self._done:
                return
            self._abandoned = True
            waiting = self._wait is not None and self._thread is not None
        if waiting:
            self._resume.release()

    def _main(self) -> None:
        try:
            self._result = self._body()
        except BaseException as exc:
            self._error = exc
        finally:
            with self._lock:
                self._done = True
            self._yielded.release()
