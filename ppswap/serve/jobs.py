"""The service's jobs: a queue, one job training at a time, cancel, and each job's events.

``JobManager.run()`` (a task of the service's task group) takes queued jobs one after
another (ppswap runs one pipeline at a time per process) and trains each: one
``run_schedule`` per step, then the optimizer step, then (shielded from a cancel, so a
completed step is always kept whole) its checkpoint (``ppswap.serve.checkpoint``) and
its record in the store. ``resume`` queues an interrupted job again: it is rebuilt from
its options, given its last checkpoint and trains the steps left, the steps an
uninterrupted job would have trained, with the same losses.

Each live job has a ``RunEvents`` stream; a task of the job's own task group moves its
events into the job's ``history`` (bounded: the oldest go first, counted in ``dropped``)
as JSON-ready dicts, and wakes whoever follows it (server-sent events). A swap job's
first event after it starts running is ``SavedBytesWithoutSwap``, measured on a twin of
its stages (``saved_bytes_without_swap``), for the live page. ``cancel`` cancels a
queued job at once and a running one through its cancel scope: the runtime tears the
run down and the next job runs on clean stages.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ppswap.events import EventsDropped, RunEvent, RunEvents, RunFinished
from ppswap.metrics import LoopLagMonitor, RankMetrics, rank_metrics
from ppswap.results import RunResult
from ppswap.serve.checkpoint import Checkpoint, JobCheckpoints
from ppswap.serve.heap import heap_frozen
from ppswap.serve.store import ACTIVE_STATES, JobRecord, JobStore
from ppswap.serve.training import (
    JobInputError,
    JobSpec,
    Training,
    parse_job,
    saved_bytes_without_swap,
)

__all__ = [
    "HISTORY_LIMIT",
    "QUEUE_LIMIT",
    "Job",
    "JobManager",
    "QueueFullError",
    "ResumeRefusedError",
    "event_json",
]

QUEUE_LIMIT = 64
HISTORY_LIMIT = 10_000


class QueueFullError(RuntimeError):
    """``QUEUE_LIMIT`` jobs are already waiting."""


class ResumeRefusedError(RuntimeError):
    """A job that cannot be resumed: ``field`` and ``reason`` say why."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


def event_json(event: RunEvent) -> dict[str, Any]:
    """An event as a JSON object: ``type`` and its fields (a ``RunFinished``: the run's
    losses, loss and step time instead of the whole ``RunResult``, and its timeline as
    ``[rank, actor, name, start_s, duration_s]`` rows)."""
    if isinstance(event, RunFinished):
        result = event.result
        return {
            "type": "RunFinished",
            "generation": event.generation,
            "time_s": event.time_s,
            "loss": _finite(result.loss),
            "losses": [_finite(v) for v in result.losses],
            "step_time_s": result.step_time_s,
            "timeline": [
                [s.rank, s.actor, s.name, round(s.start_s, 7), round(s.duration_s, 7)]
                for s in event.timeline
            ],
        }
    return {"type": type(event).__name__, **dataclasses.asdict(event)}


def _first_leaf(exc: BaseException) -> BaseException:
    """The first exception that is not a group (a task group wraps what it raises)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


@dataclass
class Job:
    """A job this service runs (or ran): its spec, state and what it emits. ``history``
    keeps the timeline of the last ``RunFinished`` only (an older one loses its
    ``timeline``): a late follower gets the last step's, the memory stays bounded."""

    id: str
    spec: JobSpec
    state: str = "queued"
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY_LIMIT))
    posted: int = 0  # events put in history, in all (the next one's id)
    scope: anyio.CancelScope | None = None
    cancel_requested: bool = False
    resume_from: Checkpoint | None = None
    _changed: anyio.Event = field(default_factory=anyio.Event)
    _timeline_at: int = -1  # the id of the event that holds the kept timeline

    @property
    def first_kept(self) -> int:
        """The id of the oldest event still in ``history``."""
        return self.posted - len(self.history)

    def post(self, kind: str, **fields: Any) -> None:
        if "timeline" in fields:
            if self._timeline_at >= self.first_kept:
                index = self._timeline_at - self.first_kept
                self.history[index] = {**self.history[index], "timeline": []}
            self._timeline_at = self.posted
        self.history.append({"type": kind, **fields})
        self.posted += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_for_news(self, seen: int, timeout_s: float) -> None:
        """Until an event after the ``seen`` first ones is posted or the job ends
        (``timeout_s`` at most)."""
        if self.posted > seen or self.state not in ACTIVE_STATES:
            return
        with anyio.move_on_after(timeout_s):
            await self._changed.wait()


class JobManager:
    """The queue and the trainer (module docstring); checkpoints under
    ``checkpoint_root`` (a folder per job). ``on_step(job, step, result, metrics)`` runs
    after every finished step (the service's Prometheus gauges)."""

    def __init__(
        self,
        store: JobStore,
        lag: LoopLagMonitor,
        checkpoint_root: str | Path,
        on_step: Callable[[Job, int, RunResult, tuple[RankMetrics, ...]], None] | None = None,
    ) -> None:
        self.store = store
        self.checkpoint_root = Path(checkpoint_root)
        self.jobs: dict[str, Job] = {}
        self.running: Job | None = None
        self._lag = lag
        self.on_step = on_step
        sender, receiver = anyio.create_memory_object_stream[Job](QUEUE_LIMIT)
        self._queue_in: MemoryObjectSendStream[Job] = sender
        self._queue_out: MemoryObjectReceiveStream[Job] = receiver
        self._log = structlog.get_logger("ppswap.serve")

    @property
    def queued(self) -> int:
        return sum(job.state == "queued" for job in self.jobs.values())

    async def submit(self, spec: JobSpec) -> Job:
        """Record and queue a job; ``QueueFullError`` when ``QUEUE_LIMIT`` wait."""
        job = Job(uuid.uuid4().hex[:12], spec)
        if self._queue_in.statistics().current_buffer_used >= QUEUE_LIMIT:
            raise QueueFullError(f"{QUEUE_LIMIT} jobs are already queued; try again later")
        await self.store.insert(
            JobRecord(id=job.id, state="queued", options=spec.request, steps=spec.steps)
        )
        self.jobs[job.id] = job
        self._queue_in.send_nowait(job)
        job.post("JobState", state="queued")
        self._log.info("job_queued", run_id=job.id, options=dict(spec.request))
        return job

    async def resume(self, record: JobRecord) -> Job:
        """Queue the interrupted job ``record`` again, from its last checkpoint.
        ``ResumeRefusedError`` (nothing queued) when it is not interrupted, has no
        checkpoint or is resumed already; ``QueueFullError`` when ``QUEUE_LIMIT`` wait."""
        if record.state != "interrupted":
            reason = f"run {record.id} is {record.state}; only an interrupted run can be resumed"
            raise ResumeRefusedError("id", reason)
        try:
            spec = parse_job(record.options)
        except JobInputError as exc:  # options this version of the service refuses
            raise ResumeRefusedError(exc.field, exc.reason) from exc
        checkpoints = JobCheckpoints(self.checkpoint_root, record.id)
        checkpoint = await anyio.to_thread.run_sync(checkpoints.latest)
        if checkpoint is None:
            reason = f"run {record.id} has no checkpoint: it stopped before its first step ended"
            raise ResumeRefusedError("id", reason)
        if record.id in self.jobs:  # checked and taken with no await between
            raise ResumeRefusedError("id", f"run {record.id} is resumed already")
        if self._queue_in.statistics().current_buffer_used >= QUEUE_LIMIT:
            raise QueueFullError(f"{QUEUE_LIMIT} jobs are already queued; try again later")
        job = Job(record.id, spec, resume_from=checkpoint)
        self.jobs[job.id] = job
        await self.store.update(job.id, state="queued", error=None)
        self._queue_in.send_nowait(job)
        job.post("JobState", state="queued", resumed_from=checkpoint.steps_done)
        self._log.info("job_resumed", run_id=job.id, steps_done=checkpoint.steps_done)
        return job

    async def cancel(self, job: Job) -> None:
        """Cancel a queued or running job (the caller checked that it is one)."""
        job.cancel_requested = True
        if job.state == "queued":
            await self._end(job, "cancelled")
        elif job.scope is not None:
            job.scope.cancel()

    async def run(self) -> None:
        """Train queued jobs one after another, until cancelled."""
        async with self._queue_out:
            async for job in self._queue_out:
                if job.state != "queued":  # cancelled while it waited
                    continue
                await self._train(job)

    async def _end(self, job: Job, state: str, error: str | None = None) -> None:
        job.state = state
        job.post("JobState", state=state, error=error)  # a follower's last event
        with anyio.CancelScope(shield=True):
            await self.store.update(job.id, state=state, error=error)
        self._log.info("job_" + state, run_id=job.id, error=error)

    async def _train(self, job: Job) -> None:
        log = self._log.bind(run_id=job.id)
        job.state = "running"
        self.running = job
        await self.store.update(job.id, state="running")
        job.post("JobState", state="running")
        log.info("job_running")
        events = RunEvents(timeline=True)
        error: str | None = None
        scope = anyio.CancelScope()
        job.scope = scope
        if job.cancel_requested:
            scope.cancel()
        try:
            # The pump is outside the job's cancel scope: it forwards the run's last
            # events (RunCancelled) after a cancellation, until the stream is closed.
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._pump, job, events)
                try:
                    with scope:
                        if job.spec.options.swap:  # before the job's build (both seed RNGs)
                            without = await saved_bytes_without_swap(job.spec)
                            rows = [
                                {"rank": r, "peak_saved_bytes": b} for r, b in enumerate(without)
                            ]
                            job.post("SavedBytesWithoutSwap", ranks=rows)
                        training = await anyio.to_thread.run_sync(Training, job.spec)
                        await self._steps(job, training, events, log)
                finally:
                    events.close()
        except Exception as exc:  # a failed run (PipelineError) or a failed build
            first = _first_leaf(exc)
            error = (str(first).splitlines() or [type(first).__name__])[0]
            log.error("job_error", error=error, error_type=type(first).__name__)
        finally:
            job.scope = None
            self.running = None
        if error is not None:
            await self._end(job, "failed", error)
        elif scope.cancelled_caught or job.cancel_requested:
            await self._end(job, "cancelled")
        else:
            await self._end(job, "finished")

    async def _steps(
        self, job: Job, training: Training, events: RunEvents, log: structlog.BoundLogger
    ) -> None:
        """The job's steps, from its checkpoint (``job.resume_from``) or the first, each
        kept (checkpoint and store, shielded) before the next begins. The framework and
        the model are built by now: the steps run on a frozen heap (``ppswap.serve.heap``)
        so that full collections do not scan them."""
        checkpoints = JobCheckpoints(self.checkpoint_root, job.id)
        losses: list[float] = []
        step_times: list[float] = []
        with heap_frozen():
            if job.resume_from is not None:
                start = job.resume_from
                await anyio.to_thread.run_sync(checkpoints.restore, training, start)
                losses, step_times = list(start.losses), list(start.step_times)
                await self.store.update(job.id, losses=losses, step_times=step_times)
                log.info("job_restored", steps_done=start.steps_done)
            while training.steps_done < job.spec.steps:
                step = training.steps_done
                self._lag.take_max_s()
                result = await training.step(events)
                metrics = rank_metrics(result, loop_lag_s=self._lag.take_max_s())
                losses.append(result.loss)
                step_times.append(result.step_time_s)
                with anyio.CancelScope(shield=True):  # a completed step is kept
                    await anyio.to_thread.run_sync(checkpoints.save, training, losses, step_times)
                    await self._record_step(job, step, result, metrics, losses, step_times)
                log.info("step_finished", step=step, loss=result.loss)

    async def _record_step(
        self,
        job: Job,
        step: int,
        result: RunResult,
        metrics: tuple[RankMetrics, ...],
        losses: list[float],
        step_times: list[float],
    ) -> None:
        rows = [dataclasses.asdict(m) for m in metrics]
        await self.store.update(job.id, losses=losses, step_times=step_times, metrics=rows)
        job.post("StepFinished", step=step, loss=_finite(result.loss), ranks=rows)
        if self.on_step is not None:
            self.on_step(job, step, result, metrics)

    async def _pump(self, job: Job, events: RunEvents) -> None:
        async for event in events:
            if isinstance(event, EventsDropped):
                job.post("EventsDropped", count=event.count)
            else:
                payload = event_json(event)
                job.post(payload.pop("type"), **payload)
