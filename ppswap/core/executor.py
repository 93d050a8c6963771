"""DedicatedThread: one named OS thread that runs submitted callables, one at a time, in order.

Why not ``anyio.to_thread.run_sync``: MindSpore's PyNative autograd is not thread-safe, so
every MindSpore call of a process must run on the *same* thread; a capacity limiter of 1
bounds concurrency but does not pin the thread. The runtime therefore starts exactly one
compute thread per run (and one copy thread per rank for the copy stream), and stops them
cooperatively when the run's task group exits.

Contract:

- ``await thread.run(fn, *args)`` queues ``fn`` (FIFO) and waits for its result; an exception
  raised by ``fn`` is re-raised in the awaiting task.
- ``await thread.run_urgent(fn, *args)`` does the same on a second lane that the thread
  serves first: the job runs as soon as the job in progress ends, ahead of every ``run``
  job still queued (FIFO among urgent jobs). For short bookkeeping jobs that gate other
  work: in-process ranks share the one compute thread, and a rank's swap step (which only
  starts or finishes a copy) must not wait behind the compute other ranks have queued, as
  it would not on a device of its own.
- Cancelling the awaiting task does not interrupt ``fn`` (nothing can interrupt a running
  Python call on another thread). The job still runs to completion; its result is dropped.
  Deadlines are therefore set on *waits* (``timeout_s``: the wait raises
  ``JobDeadlineError`` when the job has not finished by then), and teardown waits for the
  job in flight.
- Completion is signalled to the event loop with ``loop.call_soon_threadsafe``: this module
  needs the asyncio backend (what pytest-asyncio and MindSpore users run). Completions
  that pile up before the loop gets to them are delivered by one callback (one wake-up of
  the loop for a burst of jobs: in-process ranks queue their jobs on the one thread).
- A job may give the thread up and go on later: it returns a ``Resume`` instead of its
  result, and the thread runs ``resume.then()`` as the job's continuation once
  ``resume.after`` (a ``ThreadWait``) is ready, or at once behind the jobs queued now
  (``after=None``: a yield). Meanwhile it serves other jobs: ranks that share the thread
  wait for each other's payloads *parked*, never blocking it. A continuation whose
  ``after`` is not ready within ``deadline_s`` runs anyway (it sees that and raises).
  The awaiting task gets the result of the last continuation; ``timeout_s`` covers them
  all. ``has_waiting`` does not count parked jobs (they cannot run).
- ``stop()`` enqueues a sentinel; the thread finishes the jobs before it and exits. The
  thread is never a daemon: the owner joins it (``join_s`` bounds that wait). A thread
  started inside an event loop tells that loop when it exits, so ``join`` needs no helper
  thread (no worker of anyio's thread pool is left behind by a run).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import TracebackType
from typing import Any, Generic, TypeVar

import anyio

from ppswap.core.arrival import ThreadWait
from ppswap.core.deadlines import wait_woken

__all__ = [
    "DedicatedThread",
    "JobDeadlineError",
    "Resume",
    "ThreadStats",
    "job_name",
    "loop_caller",
]

T = TypeVar("T")


def loop_caller() -> Callable[..., None]:
    """A function that, from any thread, calls ``fn(*args)`` on the event loop running
    now (in FIFO order with the loop's other callbacks, so before a job's completion that
    is delivered after it); a closed loop drops the call."""
    loop = asyncio.get_running_loop()

    def call(fn: Callable[..., None], *args: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody listens
            loop.call_soon_threadsafe(fn, *args)

    return call


@dataclass(frozen=True, slots=True)
class Resume:
    """What a job returns to go on later (module docstring): ``then()`` continues it
    once ``after`` is ready (None: at once, behind the jobs queued now), or after
    ``deadline_s`` seconds parked; on the urgent lane if ``urgent``."""

    then: Callable[[], Any]
    after: ThreadWait | None = None
    deadline_s: float = math.inf
    urgent: bool = False


def job_name(fn: Callable[..., Any]) -> str:
    """What a job is called in errors and hang dumps: its qualified name (a ``repr`` only
    for a callable without one: a bound method's repr formats its object)."""
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else repr(fn)


class JobDeadlineError(TimeoutError):
    """A job submitted with ``timeout_s`` had not finished when the deadline passed (it
    may still be running on the thread)."""


@dataclass(frozen=True, slots=True)
class ThreadStats:
    """What a DedicatedThread did: jobs run (a job that resumed counts once per part it
    ran) and seconds spent inside them."""

    name: str
    jobs_run: int
    busy_s: float
    alive: bool


class _Job(Generic[T]):
    __slots__ = ("args", "error", "finished", "fn", "future", "loop", "progress", "result")

    def __init__(
        self,
        fn: Callable[..., T | Resume],
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        progress: Callable[[], str] | None,
    ) -> None:
        self.fn = fn
        self.args = args
        self.loop = loop
        self.progress = progress
        # A bare loop future (not an anyio Event): one hop is the runtime's unit of cost.
        self.future: asyncio.Future[None] = loop.create_future()
        self.result: T | None = None
        self.error: BaseException | None = None
        self.finished = False

    def finish(self) -> None:
        """Event loop: wake the awaiting task (unless it was cancelled meanwhile)."""
        self.finished = True
        if not self.future.done():
            self.future.set_result(None)


_STOP = object()


@dataclass(eq=False, slots=True)
class _Parked:
    """A job waiting for its ``Resume.after`` (identity-hashed: a token)."""

    job: _Job[Any]
    urgent: bool
    deadline: float  # time.monotonic()


class DedicatedThread:
    """A single worker thread with two FIFO job lanes, urgent first (module docstring)."""

    def __init__(self, name: str, *, join_s: float = 30.0) -> None:
        self.name = name
        self._join_s = join_s
        self._ready = threading.Condition()
        self._delivery = threading.Lock()
        # Per loop, finished jobs whose delivery callback is scheduled and has not run yet.
        self._finished: dict[asyncio.AbstractEventLoop, list[_Job[Any]]] = {}
        self._urgent: deque[_Job[Any]] = deque()
        self._normal: deque[Any] = deque()  # jobs and the stop sentinel
        self._parked: dict[_Parked, None] = {}  # in parking order; guarded by _ready
        self._thread: threading.Thread | None = None
        self._jobs_run = 0
        self._busy_s = 0.0
        self._current: str | None = None
        self._running: _Job[Any] | None = None  # with _current; read by current_job
        self._running_since = 0.0
        self._exit_loop: asyncio.AbstractEventLoop | None = None
        self._exited: anyio.Event | None = None

    # -- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError(f"thread {self.name!r} was already started")
        with contextlib.suppress(RuntimeError):  # no running loop: join() uses a helper
            self._exit_loop = asyncio.get_running_loop()
            self._exited = anyio.Event()
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=False)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to exit after the jobs already queued (non-blocking)."""
        if self._thread is not None:
            self._put(_STOP, urgent=False)

    async def join(self) -> None:
        """Wait (off the event loop, bounded by ``join_s``) for the thread to exit."""
        thread = self._thread
        if thread is None:
            return
        with anyio.CancelScope(shield=True):
            if self._exited is not None and self._exit_loop is asyncio.get_running_loop():
                with anyio.move_on_after(self._join_s):
                    await self._exited.wait()
                if self._exited.is_set():
                    thread.join()  # at once: the thread is past its last statement
            else:
                await anyio.to_thread.run_sync(thread.join, self._join_s)
        if thread.is_alive():
            raise RuntimeError(
                f"thread {self.name!r} did not stop within {self._join_s}s "
                f"(still running {self._current!r})"
            )

    async def __aenter__(self) -> DedicatedThread:
        self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        await self.join()

    def has_waiting(self) -> bool:
        """Whether a job is queued behind the one running (any thread may ask)."""
        return bool(self._urgent) or bool(self._normal)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def current_job(self) -> str | None:
        """What runs now, for hang dumps and deadline errors: the callable's name, and
        where the job is (its ``progress``) and for how long, when it says."""
        name, job = self._current, self._running
        if name is None or job is None or job.progress is None:
            return name
        seconds = time.perf_counter() - self._running_since
        return f"{name} ({job.progress()}, for {seconds:.2f}s)"

    def stats(self) -> ThreadStats:
        return ThreadStats(self.name, self._jobs_run, self._busy_s, self.is_alive)

    # -- work -------------------------------------------------------------------------
    async def run(
        self,
        fn: Callable[..., T | Resume],
        *args: Any,
        timeout_s: float = math.inf,
        progress: Callable[[], str] | None = None,
    ) -> T:
        """Run ``fn(*args)`` on the thread and return its result (see module docstring).

        ``timeout_s`` bounds the wait (``JobDeadlineError``; the job runs on). With
        ``progress``, it bounds the time without progress instead: ``progress()`` says
        where the job is (also for ``current_job``), and each time it reads differently
        from the last time the deadline passed, the wait goes on for another
        ``timeout_s``. It is called from the loop while the job runs, so it must only
        read."""
        return await self._submit(fn, args, urgent=False, timeout_s=timeout_s, progress=progress)

    async def run_urgent(
        self,
        fn: Callable[..., T | Resume],
        *args: Any,
        timeout_s: float = math.inf,
        progress: Callable[[], str] | None = None,
    ) -> T:
        """``run``, served ahead of every ``run`` job still queued (see module docstring)."""
        return await self._submit(fn, args, urgent=True, timeout_s=timeout_s, progress=progress)

    async def _submit(
        self,
        fn: Callable[..., T | Resume],
        args: tuple[Any, ...],
        *,
        urgent: bool,
        timeout_s: float,
        progress: Callable[[], str] | None,
    ) -> T:
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError(f"thread {self.name!r} is not running")
        loop = asyncio.get_running_loop()
        job: _Job[T] = _Job(fn, args, loop, progress)
        self._put(job, urgent=urgent)
        last = None if progress is None else progress()
        while True:
            await wait_woken(job.future, timeout_s)
            if job.finished or progress is None:
                break
            now = progress()
            if now == last:  # nothing moved for timeout_s
                break
            last, job.future = now, loop.create_future()  # a new window
        if not job.finished:
            name = job_name(fn)
            raise JobDeadlineError(f"job {name} not finished within {timeout_s}s")
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[return-value]

    def _serve(self) -> None:
        try:
            self._serve_jobs()
        finally:
            loop, exited = self._exit_loop, self._exited
            if loop is not None and exited is not None:
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody joins
                    loop.call_soon_threadsafe(exited.set)

    def _put(self, item: Any, *, urgent: bool) -> None:
        with self._ready:
            (self._urgent if urgent else self._normal).append(item)
            self._ready.notify()

    def _next(self) -> Any:
        with self._ready:
            while True:
                until = self._expire_parked() if self._parked else None
                if self._urgent or self._normal:
                    return self._urgent.popleft() if self._urgent else self._normal.popleft()
                self._ready.wait(until)

    def _expire_parked(self) -> float | None:
        """Under ``_ready``: queue the parked jobs past their deadline (urgent: they
        fail at once); the seconds until the next deadline (None: none is finite)."""
        now = time.monotonic()
        expired = [parked for parked in self._parked if parked.deadline <= now]
        for parked in expired:
            del self._parked[parked]
            self._urgent.append(parked.job)
        deadlines = [parked.deadline - now for parked in self._parked]
        finite = [seconds for seconds in deadlines if seconds != math.inf]
        return min(finite) if finite else None

    def _serve_jobs(self) -> None:
        while True:
            item = self._next()
            if item is _STOP:
                return
            job: _Job[Any] = item
            started = time.perf_counter()
            self._running, self._running_since = job, started
            self._current = job_name(job.fn)
            resume: Resume | None = None
            try:
                result = job.fn(*job.args)
                if isinstance(result, Resume):
                    resume = result
                else:
                    job.result = result
            except BaseException as exc:  # handed to the awaiting task, which re-raises
                job.error = exc
            finally:
                self._busy_s += time.perf_counter() - started
                self._jobs_run += 1
                self._current = None
                self._running = None
            if resume is None:
                self._notify(job)
            else:
                self._park(job, resume)

    def _park(self, job: _Job[Any], resume: Resume) -> None:
        """Thread: queue the job's continuation now, or once ``resume.after`` is ready."""
        job.fn, job.args = resume.then, ()
        after = resume.after
        if after is None:
            self._put(job, urgent=resume.urgent)
            return
        parked = _Parked(job, resume.urgent, time.monotonic() + resume.deadline_s)
        with self._ready:
            self._parked[parked] = None
        after.on_ready(partial(self._unpark, parked))

    def _unpark(self, parked: _Parked) -> None:
        """Any thread (the one that made ``after`` ready): queue a parked job."""
        with self._ready:
            if parked in self._parked:  # else its deadline queued it already
                del self._parked[parked]
                (self._urgent if parked.urgent else self._normal).append(parked.job)
                self._ready.notify()

    def _notify(self, job: _Job[Any]) -> None:
        """Thread: hand a finished job to its loop; one callback per burst (module doc)."""
        loop = job.loop
        with self._delivery:
            burst = self._finished.get(loop)
            if burst is not None:
                burst.append(job)
                return
            self._finished[loop] = [job]
        try:
            loop.call_soon_threadsafe(self._deliver, loop)
        except RuntimeError:  # the loop is closed: nobody awaits these jobs any more
            with self._delivery:
                self._finished.pop(loop, None)

    def _deliver(self, loop: asyncio.AbstractEventLoop) -> None:
        """Event loop: wake the tasks awaiting every job finished since the last call."""
        with self._delivery:
            jobs = self._finished.pop(loop, [])
        for job in jobs:
            job.finish()
