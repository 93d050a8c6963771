"""StepWaits: the compute actor's waits, each bounded by the step deadline.

A compute actor waits on the event loop for two things: a job on the compute thread (a
batch, which itself waits for the inputs of its steps on the thread) and a reply future
(a send's completion, at the end of the order). Each wait has the deadline
``timeout_s``; a missed one raises the ``PipelineHangError`` of ``StepFailures.hang``
(with the flight recorder's dump), naming the step that waited. While a wait is in
progress it is listed in ``waiting`` for hang dumps; a wait that failed stays listed.
Everything here runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ppswap.actors.failures import StepFailures
from ppswap.core.executor import DedicatedThread, JobDeadlineError, Resume, job_name
from ppswap.core.messages import FutureTimeoutError, ReplyFuture
from ppswap.scheduler.steps import MetaStep

__all__ = ["StepWaits"]

T = TypeVar("T")


class StepWaits:
    """One compute actor's deadline-bounded waits (module docstring). ``exposed_copy_s``
    sums the time batches waited for copies on the thread."""

    def __init__(self, compute: DedicatedThread, errors: StepFailures, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.waiting: dict[int, str] = {}  # id(what is awaited) -> who waits for what
        self.exposed_copy_s = 0.0
        self._compute = compute
        self._errors = errors

    async def reply(self, future: ReplyFuture[T], step: MetaStep) -> T:
        """The future's result, waited for at most the deadline."""
        if future.done:
            return future.result()
        self.waiting[id(future)] = f"{step.short()} waits for {future.label}"
        try:
            result = await future.wait(self.timeout_s)
        except FutureTimeoutError as exc:
            raise self._errors.hang(step, str(exc)) from exc
        # Only on success: a wait that failed stays listed for the hang dump.
        del self.waiting[id(future)]
        return result

    async def call(
        self,
        at: MetaStep | str | Callable[[], MetaStep] | None,
        fn: Callable[..., T | Resume],
        *args: Any,
        urgent: bool = False,
        timeout_s: float | None = None,
        progress: Callable[[], str] | None = None,
    ) -> T:
        """Run ``fn(*args)`` on the compute thread with the step deadline, or
        ``timeout_s`` (the job itself cannot be interrupted: on a missed deadline the run
        fails, naming ``at``, or ``at()``: where a batch is then; teardown waits for the
        job). ``urgent``: on the thread's urgent lane, ahead of the leaves queued there;
        ``progress``: where the job is, the deadline then bounds the time without progress
        (``DedicatedThread.run``).

        The message of a missed deadline says what the thread is running then: where
        ranks share the thread, the job that holds it may be another rank's (the one
        stuck), with this rank's job queued or parked behind it."""
        submit = self._compute.run_urgent if urgent else self._compute.run
        deadline_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            return await submit(fn, *args, timeout_s=deadline_s, progress=progress)
        except JobDeadlineError:
            pass
        message = f"compute job {job_name(fn)} still running after {deadline_s}s"
        running = self._compute.current_job
        if progress is not None:
            message = f"compute job {job_name(fn)} made no progress for {deadline_s}s"
            message += f" ({progress()})"
        message += f"; the compute thread is running {running or 'nothing'}"
        where = at() if callable(at) else at
        where = where if where is not None else "idle"
        raise self._errors.hang(where, message)
