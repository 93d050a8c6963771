"""The copy-stream actor: a rank's copy streams, one per direction.

A rank's offloads and loads are *launched* onto its copy stream by the compute thread
(``CopyStream.launch(step, job)``, inside the job of the swap step: no event-loop round
trip) and *run* on the stream's own threads (never the compute thread, never the event
loop): offloads in launch order, one at a time, on the rank's D2H thread
(``ppswap-copy-<rank>``), loads likewise on its H2D thread (``ppswap-load-<rank>``), as a
device runs its two directions on separate copy engines, so a load never waits behind an
unrelated offload. A chunk's load is prepared only once its offload finished (the swap
layer's phases), so the two queues need no ordering between them.
``split_directions=False`` runs both on one thread in launch order (one copy engine:
``benchmarks/bench_copy_streams.py`` compares). ``launch`` returns the job's
:class:`CopyCompletion`, which
SWAP_WAIT_* awaits; a failed copy sets it with the ``PipelineError`` this actor reports
(naming the rank, ``copy`` and the launch step), so the run reports the copy, not the
compute step that waited for it. A copy cancelled unrun because another copy failed
carries that failure too: a wait on it reports the root cause.

The actor owns the stream's lifecycle: ``run()`` starts its threads and returns when the
compute actor has closed the stream (``close()``, after its last step) and every launched
copy has run; a copy that fails ends the run at once. On cancellation or failure the
copies still queued are cancelled (``CopyJob.cancel``: their buffers go back to the pool)
and the copy in flight is waited for (shielded, bounded by ``timeout_s``, then
``PipelineHangError``), so no copy is in flight once this actor has exited. A
``FaultPlan`` (tests) can fail or delay a copy before it starts; a delay is a wait that
cancellation interrupts.
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

import anyio
import structlog

from ppswap.actors.trace import FlightRecorder
from ppswap.backends.base import CopyEvent
from ppswap.core.arrival import ArrivalTimeoutError
from ppswap.core.deadlines import resolve, wait_woken
from ppswap.core.faults import FaultAction, FaultPlan, FaultSite
from ppswap.core.oneshot import OneShot
from ppswap.errors import PipelineError, PipelineHangError, named_failure
from ppswap.logs import log_step
from ppswap.scheduler.steps import MetaStep
from ppswap.swap.jobs import CopyJob, JobKind

__all__ = ["CopyCompletion", "CopyStats", "CopyStream", "CopyStreamActor", "CopyWait"]


@dataclass(frozen=True, slots=True)
class CopyStats:
    copies: int
    bytes_copied: int
    busy_s: float


class CopyCompletion(CopyEvent):
    """A launched copy's completion: set when it ran (``moved`` bytes) or failed
    (``error``, a ``PipelineError`` naming the copy), or when it was cancelled unrun
    after another copy failed (``error`` is that copy's failure)."""

    __slots__ = ("error", "label", "moved")

    def __init__(self, label: str) -> None:
        super().__init__()
        self.label = label
        self.moved = 0
        self.error: PipelineError | None = None

    async def wait_async(self, timeout_s: float) -> bool:
        """Event loop: wait until set, at most ``timeout_s``; whether it is set. The copy
        thread wakes the loop (no thread waits for the event)."""
        if self.is_set():
            return True
        loop = asyncio.get_running_loop()
        woken: asyncio.Future[None] = loop.create_future()

        def wake() -> None:  # on the thread that sets the event
            loop.call_soon_threadsafe(resolve, woken)

        self.on_set(wake)
        await wait_woken(woken, timeout_s)
        return self.is_set()


class CopyWait:
    """A launched copy's completion as a ``ThreadWait``: a batch's SWAP_WAIT_* whose copy
    is still running waits for it on the compute thread (blocking when the rank is alone
    in its process, parked when ranks share the thread) instead of going back to the
    event loop. ``wait`` raises the copy's error; ``abandon`` wakes the thread while the
    copy runs on."""

    __slots__ = ("_woken", "completion")

    def __init__(self, completion: CopyCompletion) -> None:
        self.completion = completion
        # None once the copy's completion is set, else why the wait was abandoned
        self._woken: OneShot[str | None] = OneShot()
        completion.on_set(partial(self._woken.set_value, None))

    @property
    def label(self) -> str:
        return self.completion.label  # named by its launch (``CopyStream.launch``)

    @property
    def ready(self) -> bool:
        return self._woken.is_set()

    def wait(self, timeout_s: float) -> None:
        if not self._woken.wait(timeout_s):
            raise ArrivalTimeoutError(f"{self.label} not done within {timeout_s}s")
        abandoned = self._woken.value
        if abandoned is not None:
            raise RuntimeError(f"{self.label}: {abandoned}")
        if self.completion.error is not None:
            raise self.completion.error

    def abandon(self, reason: str) -> None:
        self._woken.set_value(reason)

    def on_ready(self, callback: Callable[[], None]) -> None:
        self._woken.on_set(callback)


@dataclass(slots=True)
class _Launch:
    step: MetaStep
    job: CopyJob
    completion: CopyCompletion


_CLOSE = object()


class _Lane:
    """One direction's FIFO and the thread that runs it."""

    def __init__(self, thread_name: str) -> None:
        self.thread_name = thread_name
        self.queue: deque[_Launch | object] = deque()
        self.thread: threading.Thread | None = None
        self.current: str | None = None


class CopyStream:
    """The FIFOs of one rank's copies and the threads that run them (module docstring).

    ``launch`` may be called from any thread; everything else from the event loop.
    """

    def __init__(
        self,
        rank: int,
        recorder: FlightRecorder,
        *,
        faults: FaultPlan | None = None,
        generation: int = 0,
        log_steps: bool = False,
        split_directions: bool = True,
    ) -> None:
        self.rank = rank
        self._recorder = recorder
        self._faults = faults
        self._generation = generation
        self._log_steps = log_steps
        self._log = structlog.get_logger("ppswap").bind(rank=rank, actor="copy")
        self._ready = threading.Condition()
        self._offloads = _Lane(f"ppswap-copy-{rank}")
        self._loads = _Lane(f"ppswap-load-{rank}") if split_directions else self._offloads
        self._lanes = [self._offloads] + [self._loads] * split_directions
        self._running = 0  # threads started and not yet exited
        self._interrupt = threading.Event()
        self._started = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._settled: anyio.Event | None = None  # a copy failed, or every thread exited
        self._drained: anyio.Event | None = None  # every thread exited
        self.failure: PipelineError | None = None
        self._copies = 0
        self._bytes = 0
        self._busy_s = 0.0

    def stats(self) -> CopyStats:
        """Copies run, their bytes and the seconds they took (summed over the threads)."""
        with self._ready:
            return CopyStats(self._copies, self._bytes, self._busy_s)

    @property
    def current(self) -> str | None:
        """A copy running now (the offload's first), or None."""
        return next((lane.current for lane in self._lanes if lane.current), None)

    def pending(self) -> list[str]:
        """What is queued or running, for hang dumps (labels like ``copy LO0.0 320B``)."""
        with self._ready:
            running = [lane.current for lane in self._lanes if lane.current]
            queued = [
                item.completion.label
                for lane in self._lanes
                for item in lane.queue
                if isinstance(item, _Launch)
            ]
        return running + queued

    # -- any thread ---------------------------------------------------------------------
    def launch(
        self, step: MetaStep, job: CopyJob, completion: CopyCompletion | None = None
    ) -> CopyCompletion:
        """Queue ``job`` (prepared for ``step``) behind the stream's earlier copies; its
        completion is ``completion`` where the caller made it beforehand (a SWAP_WAIT_*
        of the same batch waits for it), else a new one."""
        label = f"copy {step.short()} {job.nbytes}B"
        if completion is None:
            completion = CopyCompletion(label)
        else:
            completion.label = label
        lane = self._loads if job.kind is JobKind.LOAD else self._offloads
        with self._ready:
            if self.failure is not None:
                raise self.failure
            if not self._started or self._interrupt.is_set():
                raise RuntimeError(f"copy stream of rank {self.rank} is not running")
            lane.queue.append(_Launch(step, job, completion))
            self._ready.notify_all()
        return completion

    # -- event loop: lifecycle ------------------------------------------------------------
    def start(self, *, thread: bool = True) -> None:
        """Start the stream's threads; ``thread=False`` for a rank whose order launches no
        copy: no thread is made, ``launch`` refuses, and the stream is finished as soon as
        it is closed or interrupted."""
        self._loop = asyncio.get_running_loop()
        self._settled = anyio.Event()
        self._drained = anyio.Event()
        if not thread:
            return
        for lane in self._lanes:
            lane.thread = threading.Thread(
                target=self._serve, args=(lane,), name=lane.thread_name, daemon=False
            )
        with self._ready:
            self._started = True
            self._running = len(self._lanes)
        for lane in self._lanes:
            assert lane.thread is not None
            lane.thread.start()

    def close(self) -> None:
        """No more launches: the threads run what is queued, then exit."""
        with self._ready:
            for lane in self._lanes:
                lane.queue.append(_CLOSE)
            self._ready.notify_all()
        self._end_threadless()

    def _end_threadless(self) -> None:
        if not self._started and self._settled is not None and self._drained is not None:
            self._drained.set()
            self._settled.set()

    def interrupt(self) -> None:
        """Cancel every queued copy and cut a fault-injected delay short (teardown)."""
        with self._ready:
            dropped = [
                item for lane in self._lanes for item in lane.queue if isinstance(item, _Launch)
            ]
            for lane in self._lanes:
                lane.queue.clear()
                lane.queue.append(_CLOSE)
            self._interrupt.set()
            self._ready.notify_all()
        for item in dropped:
            item.job.cancel()
            item.completion.set()
        self._end_threadless()

    async def finished(self) -> None:
        """Return when the thread exited after ``close``; raise the first copy failure
        as soon as it happens."""
        assert self._settled is not None
        await self._settled.wait()
        if self.failure is not None:
            raise self.failure

    async def join(self, timeout_s: float) -> None:
        """Wait (shielded, bounded) for the threads to exit; the copies in flight run to
        their end. ``PipelineHangError`` if one is still running after ``timeout_s``."""
        if not self._started:
            return
        with anyio.CancelScope(shield=True):
            assert self._drained is not None
            with anyio.move_on_after(timeout_s):
                await self._drained.wait()
            if not self._drained.is_set():
                raise PipelineHangError(
                    f"copy still running after {timeout_s}s",
                    rank=self.rank,
                    actor="copy",
                    step=self.current,
                    dump=self._recorder.dump(),
                )
            for lane in self._lanes:
                if lane.thread is not None:
                    lane.thread.join()

    # -- the stream's threads -------------------------------------------------------------
    def _next(self, lane: _Lane) -> _Launch | object:
        with self._ready:
            while not lane.queue:
                self._ready.wait()
            return lane.queue.popleft()

    def _serve(self, lane: _Lane) -> None:
        try:
            while True:
                item = self._next(lane)
                if not isinstance(item, _Launch):
                    return
                if self.failure is not None:
                    # Cancelled unrun: a wait on it raises the copy failure that caused
                    # this, not a consequence of the missing copy.
                    item.job.cancel()
                    item.completion.error = self.failure
                    item.completion.set()
                    continue
                self._run(lane, item)
        finally:
            with self._ready:
                self._running -= 1
                last = self._running == 0
            if last:
                self._notify(self._drained)
                self._notify(self._settled)

    def _run(self, lane: _Lane, item: _Launch) -> None:
        step, job, completion = item.step, item.job, item.completion
        lane.current = completion.label
        started = time.perf_counter()
        start_us = self._recorder.now_us()
        self._recorder.note(self.rank, "copy", "begin", step)
        try:
            if self._faults is not None:
                self._inject(self._faults, step)
            completion.moved = job.run()
        except BaseException as exc:
            completion.error = self._failed_copy(step, exc)
            with self._ready:
                self.failure = self.failure or completion.error
            self._recorder.note(self.rank, "copy", "FAILED", step, type(exc).__name__)
            self._notify(self._settled)
        else:
            seconds = time.perf_counter() - started
            with self._ready:
                self._busy_s += seconds
                self._copies += 1
                self._bytes += completion.moved
            self._recorder.note(self.rank, "copy", "end", step)
            self._recorder.add_span(
                self.rank, "copy", step.kind.value, start_us, chunk=step.short(), bytes=job.nbytes
            )
            if self._log_steps:
                log_step(
                    self._log,
                    "copy",
                    step,
                    self._generation,
                    bytes=completion.moved,
                    seconds=seconds,
                )
        finally:
            lane.current = None
            completion.set()

    def _failed_copy(self, step: MetaStep, exc: BaseException) -> PipelineError:
        message = f"copy failed: {exc!r}"
        return named_failure(exc, message, rank=self.rank, actor="copy", step=step.short())

    def _inject(self, faults: FaultPlan, step: MetaStep) -> None:
        """Apply the plan's copy rule: fail the copy, or hold the stream (interruptibly)."""
        rule = faults.match(FaultSite.COPY, self.rank, step)
        if rule is None:
            return
        self._recorder.note(self.rank, "copy", rule.describe(self.rank, step))
        if rule.action is FaultAction.DELAY:
            if self._interrupt.wait(rule.delay_s):
                raise PipelineError(
                    "copy cancelled during an injected delay",
                    rank=self.rank,
                    actor="copy",
                    step=step.short(),
                )
        else:
            rule.raise_fault(self.rank, step)

    def _notify(self, event: anyio.Event | None) -> None:
        loop = self._loop
        if loop is None or event is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(event.set)


class CopyStreamActor:
    """Owns one rank's :class:`CopyStream`: starts it, reports its failure, and on the
    way out waits for the copy in flight (module docstring)."""

    actor_name = "copy"

    def __init__(self, stream: CopyStream, *, timeout_s: float = math.inf) -> None:
        self.stream = stream
        self.rank = stream.rank
        self._timeout_s = timeout_s

    def stats(self) -> CopyStats:
        return self.stream.stats()

    async def run(self) -> None:
        """Serve the stream until the compute actor closed it and it drained."""
        stream = self.stream
        try:
            await stream.finished()
        except BaseException:
            stream.interrupt()
            await stream.join(self._timeout_s)
            raise
        await stream.join(self._timeout_s)
