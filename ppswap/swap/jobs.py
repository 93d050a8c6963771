"""CopyJob: one unit of copy work, prepared on the compute thread, run on the copy thread.

A job goes NEW -> RUNNING -> DONE (or NEW -> CANCELLED). ``run()`` executes its work once
on the caller's thread (the copy thread) and returns the bytes it moved; a second
``run()`` raises :class:`SwapStateError`. ``done`` is a ``threading.Event`` set when the
job finished (successfully or not) or was cancelled, so the compute thread can wait for it
with a timeout (:meth:`CopyJob.wait`). If the work raises, the exception is kept in
``error``, ``done`` is still set, and ``run()`` re-raises it for the copy actor to report.

A job cancelled before it started does nothing when it is later run (returns 0): that is
how ``abort()`` stops queued copies without racing the copy thread.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable

from ppswap.swap.errors import SwapStateError, SwapTimeoutError

__all__ = ["CopyJob", "JobKind", "JobPhase"]


class JobKind(enum.Enum):
    OFFLOAD = "offload"
    LOAD = "load"


class JobPhase(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    DONE = "done"
    CANCELLED = "cancelled"


class CopyJob:
    """A prepared copy of one group's bytes (``nbytes``) in one direction (``kind``)."""

    def __init__(
        self,
        *,
        kind: JobKind,
        group: str,
        nbytes: int,
        work: Callable[[], None] | None,
        on_cancel: Callable[[], None] | None = None,
    ) -> None:
        self.kind = kind
        self.group = group
        self.nbytes = nbytes
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._work = work
        self._on_cancel = on_cancel
        self._lock = threading.Lock()
        self._phase = JobPhase.NEW

    @classmethod
    def empty(cls, kind: JobKind, group: str) -> CopyJob:
        """A job with nothing to move (``run()`` returns 0)."""
        return cls(kind=kind, group=group, nbytes=0, work=None)

    @property
    def phase(self) -> JobPhase:
        with self._lock:
            return self._phase

    @property
    def started(self) -> bool:
        return self.phase is not JobPhase.NEW

    @property
    def finished(self) -> bool:
        """True once the work ran to its end (successfully or with ``error``)."""
        return self.phase is JobPhase.DONE

    def run(self) -> int:
        """Execute the copy on this thread; return the bytes moved (0 if cancelled)."""
        with self._lock:
            if self._phase is JobPhase.CANCELLED:
                return 0
            if self._phase is not JobPhase.NEW:
                raise SwapStateError(
                    group=self.group,
                    tag=f"<{self.kind.value} job>",
                    from_state=self._phase.value,
                    to_state=JobPhase.RUNNING.value,
                    detail="a copy job runs once",
                )
            self._phase = JobPhase.RUNNING
            self._on_cancel = None  # a started job is never cancelled: its plan can go
        try:
            if self._work is not None:
                self._work()
        except BaseException as exc:
            self.error = exc
            raise
        finally:
            self._work = None
            with self._lock:
                self._phase = JobPhase.DONE
            self.done.set()
        return self.nbytes

    def cancel(self) -> bool:
        """Cancel if not started yet (then ``done`` is set); return whether it was."""
        with self._lock:
            if self._phase is not JobPhase.NEW:
                return False
            self._phase = JobPhase.CANCELLED
            self._work = None
            on_cancel, self._on_cancel = self._on_cancel, None
        if on_cancel is not None:
            on_cancel()
        self.done.set()
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until ``done`` (at most ``timeout_s``); raise SwapTimeoutError on expiry."""
        if not self.done.wait(timeout_s):
            raise SwapTimeoutError(
                f"{self.kind.value} copy of group {self.group!r} ({self.nbytes} bytes) "
                f"did not finish within {timeout_s} s (phase {self.phase.value}); "
                "is the copy thread running its jobs?"
            )

    def __repr__(self) -> str:
        return (
            f"CopyJob(kind={self.kind.value}, group={self.group!r}, nbytes={self.nbytes}, "
            f"phase={self.phase.value})"
        )
