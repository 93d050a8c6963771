"""Batches: consecutive steps of a rank run as one job on the compute thread.

A hop to the compute thread and back costs tens of microseconds, about as much as the
bookkeeping of a swap step itself, so the compute actor hands over every run of
consecutive steps that are ready and need no other actor as *one* job: a FWD and the swap
launch that follows it, a swap wait whose copy is done and the BWD after it. The job runs
the steps' bodies in order and times each one on the thread; the first body that raises
ends the job, and the outcome says which step it was. ``StepBodies`` holds those bodies.

When the rank is the only one of its process, a FWD or BWD whose received input is not
there yet can still join a batch: its job carries the receive's ``Arrival``, and the
thread waits for it (with the step deadline) before the body runs, instead of ending the
batch and going back to the event loop (``core.arrival``). So can a SWAP_WAIT_* whose copy
is still running, or is launched by an earlier job of the same batch (its job carries a
``CopyWait``). The wait is not in the step's timing; the outcome reports it on its own (a
swap wait's is the exposed copy wait). Ranks that share the thread run their batches with
``start_batch`` instead: there a job whose wait is not ready *parks* the batch
(``core.executor.Resume``) and the thread serves the others until it is; the sender's job
lands it on the thread (``hand_offs``, ``ThreadHandoff``).

A job whose result is sent to another rank (a FWD or BWD followed by its SEND) is
*announced*: its result goes to the event loop as soon as the body returns, so the send
leaves while the batch's later steps still run. A batch *yields* before a compute leaf
when other work waits for the thread (``yield_to``): ``run_batch`` returns what it ran,
and the actor queues the rest again; ``start_batch`` goes on behind the work queued,
without a trip to the loop. So the ranks' leaves interleave when they compete for the
thread (as a copy's start does: swap steps go on the urgent lane).

``ComputeStats`` sums what the batches timed, by job kind (``JOB_KINDS``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ppswap.actors.copy_stream import CopyCompletion, CopyStream
from ppswap.backends.types import Tensor
from ppswap.core.arrival import Arrival, ArrivalTimeoutError, FirstOf, ThreadWait
from ppswap.core.executor import Resume
from ppswap.core.fiber import Suspended
from ppswap.core.messages import Payload
from ppswap.core.oneshot import OneShot
from ppswap.scheduler.steps import PAYLOAD_MAKER_KINDS as _MAKES_PAYLOAD_OF
from ppswap.scheduler.steps import MetaStep
from ppswap.stage_run import StageCollector, StageRun
from ppswap.swap.jobs import CopyJob
from ppswap.transports.payloads import payload_of, tensors_of

__all__ = [
    "JOB_KINDS",
    "BatchOutcome",
    "BatchRun",
    "ComputeStats",
    "EarlySends",
    "StepBodies",
    "StepJob",
    "SwapDriver",
    "after_arrival",
    "payload_maker",
    "run_batch",
    "start_batch",
]

JOB_KINDS = (
    "forward",
    "backward",
    "backward_input",
    "backward_weight",
    "recompute",
    "swap_prepare",
    "swap_finish",
)
"""The kinds of compute-thread work ``RankStats.compute_job_s`` is split by (what a
``CostModel``'s leaf and swap-step times are measured from)."""

SWAP_JOB_KINDS = frozenset({"swap_prepare", "swap_finish"})
COMPUTE_JOB_KINDS = frozenset(JOB_KINDS) - SWAP_JOB_KINDS


@dataclass(frozen=True, slots=True)
class ComputeStats:
    """``job_s`` / ``jobs``: seconds and count of the compute-thread work by kind
    (``JOB_KINDS``), timed on the thread itself, so waiting for the thread is not in
    them; ``batches``: compute-thread jobs (hops) the actor made."""

    steps_executed: int
    exposed_copy_wait_s: float
    job_s: Mapping[str, float]
    jobs: Mapping[str, int]
    batches: int = 0


@dataclass(frozen=True, slots=True)
class StepJob:
    """The compute-thread body of one step: ``run()`` (its result goes back to the loop;
    ``announce``: as soon as it returns, not with the batch's outcome; ``arrival``: what
    the thread waits for before ``run``: a received input, which ``run`` reads
    (``after_arrival``), or a copy's completion; ``hand_offs``: called with the result
    on the thread, to hand it to a rank that shares the thread, ``ThreadHandoff.put``)."""

    step: MetaStep
    kind: str
    run: Callable[[], Any]
    announce: bool = False
    arrival: ThreadWait | None = None
    hand_offs: tuple[Callable[[Any], None], ...] = ()


def after_arrival(arrival: Arrival, body: Callable[..., Any], *rest: Any) -> Any:
    """``body(payload, *rest)`` with the payload ``arrival`` landed with (``run_batch``
    waited for it before the job's run)."""
    return body(arrival.wait(0.0), *rest)


def payload_maker(jobs: Sequence[StepJob], send: MetaStep) -> int | None:
    """The index of the job in ``jobs`` that makes the payload of ``send``, if any."""
    makers = _MAKES_PAYLOAD_OF[send.kind]
    for index in range(len(jobs) - 1, -1, -1):
        step = jobs[index].step
        if step.kind in makers and step.stage == send.stage and step.micro == send.micro:
            return index
    return None


@dataclass(slots=True, eq=False)
class EarlySends:
    """A batch's announced jobs (event loop side): by job index the sends of its payload,
    the jobs whose results were applied on announcement, a failure to post (raised with
    the batch's outcome); ``open`` until the batch's wait ends (later announcements are
    dropped)."""

    jobs: Sequence[StepJob]
    sends: Mapping[int, list[MetaStep]]
    applied: set[int] = field(default_factory=set)
    error: Exception | None = None
    open: bool = True


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What a batch did: per step that finished its result, start (``perf_counter``),
    seconds, and seconds waited for its ``arrival`` before it started; ``error`` is the
    exception of the step after the last one that finished. Fewer results than jobs and
    no error: the batch yielded the thread there."""

    results: list[Any]
    started: list[float]
    seconds: list[float]
    error: Exception | None
    waited: list[float] = field(default_factory=list)
    order: Sequence[int] = ()
    """The jobs' indices in the order they ran (the n-th result is of job ``order[n]``);
    only a batch with ``pairs`` runs any out of place. Empty: in order."""

    def job_index(self, position: int) -> int:
        """The index of the job that ran ``position``-th (or runs next, for the one
        after the last result)."""
        return self.order[position] if self.order else position


def run_batch(
    jobs: Sequence[StepJob],
    announce: Callable[[int, Any], None] | None = None,
    yield_to: Callable[[], bool] | None = None,
    arrival_timeout_s: float = math.inf,
) -> BatchOutcome:
    """Compute thread: run ``jobs`` in order, stopping at the first that raises; after an
    announced job, ``announce(index, result)``; before a compute leaf other than the
    first, stop if ``yield_to()`` (other work waits for the thread); the last job is not
    announced (its result is in the outcome, which follows at once). A job's ``arrival``
    is waited for first, blocking the thread, up to ``arrival_timeout_s``
    (``ArrivalTimeoutError``: the job fails)."""
    outcome = BatchRun(jobs, announce, yield_to, arrival_timeout_s, parks=False).run()
    assert isinstance(outcome, BatchOutcome)  # only a parking run resumes
    return outcome


def start_batch(
    jobs: Sequence[StepJob],
    announce: Callable[[int, Any], None] | None = None,
    yield_to: Callable[[], bool] | None = None,
    arrival_timeout_s: float = math.inf,
) -> BatchOutcome | Resume:
    """``run_batch`` for a thread that ranks share (``DedicatedThread``'s ``Resume``):
    where a job's ``arrival`` is not there yet the batch parks until it is (at most
    ``arrival_timeout_s``, then the job fails with ``ArrivalTimeoutError``), and where
    it would yield it goes on behind the work queued instead of ending: the thread
    serves the other ranks meanwhile, and the outcome is the whole batch's."""
    return BatchRun(jobs, announce, yield_to, arrival_timeout_s, parks=True).run()


def _until_ready(wait: ThreadWait, timeout_s: float) -> None:
    """Block until ``wait`` is over, without reading it (a suspended body reads its own
    exchange, error included); ``ArrivalTimeoutError`` after ``timeout_s``."""
    over: OneShot[None] = OneShot()

    def set_over() -> None:
        over.set_value(None)

    wait.on_ready(set_over)
    if not over.wait(timeout_s):
        raise ArrivalTimeoutError(f"{wait.label} not there within {timeout_s}s")


def _landed() -> Arrival:
    """A wait that is over: what a job of a pair that waits for nothing counts as."""
    arrival = Arrival("nothing to wait for")
    arrival.land(None)
    return arrival


@dataclass(slots=True, eq=False, repr=False)
class BatchRun:
    """One batch on the compute thread, resumable at a job (``start_batch``): ``run()``
    is the thread's job (the outcome, or a ``Resume`` where it parks or yields; only with
    ``parks``); ``now()`` says which step it is at (any thread may ask).

    ``pairs``: indices ``i`` where jobs ``i`` and ``i + 1`` may run in either order (the
    two leaves of a composite, both waiting for their inputs): the batch waits for
    whichever input comes first (``FirstOf``) and runs that job first; ``announce`` and
    the outcome's ``order`` name jobs by their index in ``jobs``."""

    jobs: Sequence[StepJob]
    announce: Callable[[int, Any], None] | None
    yield_to: Callable[[], bool] | None
    arrival_timeout_s: float
    parks: bool
    pairs: frozenset[int] = frozenset()
    order: list[int] = field(default_factory=list)  # job index per position (with pairs)
    results: list[Any] = field(default_factory=list)
    started: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    waited: list[float] = field(default_factory=list)
    resumed: bool = False  # the next job begins a part of the run: it does not yield
    parked_at: float | None = None  # when the next job parked for its arrival
    # Jobs whose body gave the thread up (a fiber, ``core.fiber``), by job index: what
    # each waits for before its body goes on.
    suspended: dict[int, ThreadWait] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.pairs:
            self.order = list(range(len(self.jobs)))

    def run(self) -> BatchOutcome | Resume:
        jobs, yield_to, pairs, order = self.jobs, self.yield_to, self.pairs, self.order
        clock = time.perf_counter
        while (position := len(self.results)) < len(jobs):
            index = order[position] if order else position
            job = jobs[index]
            if (
                position
                and not self.resumed
                and yield_to is not None
                and job.kind in COMPUTE_JOB_KINDS
                and position - 1 not in pairs  # a pair is not split by a yield
                and not self.suspended  # nor a suspended body left behind
                and yield_to()
            ):
                if not self.parks:
                    break
                self.resumed = True
                return Resume(self.run)
            self.resumed = False
            begin = clock()
            try:
                if (arrival := self._pending(index)) is not None:
                    paired = position in pairs and not arrival.ready
                    if paired:
                        index, job, arrival = self._first_ready(position)
                    if self.parks and not arrival.ready:
                        if self.parked_at is None:
                            self.parked_at, self.resumed = begin, True
                            urgent = job.kind in SWAP_JOB_KINDS
                            after = self._awaited(position) if paired else arrival
                            return Resume(self.run, after, self.arrival_timeout_s, urgent)
                        raise ArrivalTimeoutError(
                            f"{arrival.label} not there within {self.arrival_timeout_s}s"
                        )
                    if paired and not arrival.ready:  # blocking: whichever comes first
                        self._awaited(position).wait(self.arrival_timeout_s)
                        index, job, arrival = self._first_ready(position)
                    if index not in self.suspended:
                        arrival.wait(0.0 if self.parks else self.arrival_timeout_s)
                    elif not arrival.ready:  # blocking: the body reads it (and its error)
                        _until_ready(arrival, self.arrival_timeout_s)
                    ready = clock()
                    waited_s = ready - (begin if self.parked_at is None else self.parked_at)
                    begin, self.parked_at = ready, None
                else:
                    waited_s = 0.0
                result = job.run()
                if type(result) is Suspended:  # a fiber gave the thread up (core.fiber)
                    self.suspended[index] = result.wait
                    self.resumed = True
                    if position in pairs:
                        # Its partner runs meanwhile (the exchange overlaps its compute);
                        # peers may have run the pair in the other order, and wait for
                        # this rank's partner to go on.
                        order[position], order[position + 1] = order[position + 1], index
                        continue
                    if not self.parks:
                        continue  # the loop blocks until it is there, then resumes it
                    return Resume(self.run, result.wait, self.arrival_timeout_s)
                self.suspended.pop(index, None)
                for hand_off in job.hand_offs:
                    hand_off(result)
            except Exception as exc:
                return self._outcome(exc)
            self.results.append(result)
            self.started.append(begin)
            self.seconds.append(clock() - begin)
            self.waited.append(waited_s)
            # The last job's result comes back with the outcome at once: no extra wake-up.
            if job.announce and self.announce is not None and position + 1 < len(jobs):
                self.announce(index, result)
        return self._outcome(None)

    def at(self) -> MetaStep:
        """The step of the job the batch is at (its last job's once it is done)."""
        position = min(len(self.results), len(self.jobs) - 1)
        return self.jobs[self.order[position] if self.order else position].step

    def now(self) -> str:
        position, jobs, order = len(self.results), self.jobs, self.order
        if position >= len(jobs):
            return "done"
        return f"at {jobs[order[position] if order else position].step.short()}"

    def progress(self, rank: int) -> str:
        """Where the batch is, as the compute thread reports it (hang dumps, deadline
        errors)."""
        return f"rank {rank} {self.now()}"

    def _pending(self, index: int) -> ThreadWait | None:
        """What job ``index`` waits for before it runs (on): its suspended body's wait,
        else its input's arrival (None: nothing)."""
        return self.suspended.get(index, self.jobs[index].arrival)

    def _pair(self, position: int) -> tuple[StepJob, StepJob, ThreadWait, ThreadWait]:
        """The two jobs of the pair at ``position``, in their current order, and what
        each waits for (a job of a pair waits for its input, or its suspended body for
        its exchange; one that waits for nothing is a landed arrival)."""
        first_index, second_index = self.order[position], self.order[position + 1]
        return (
            self.jobs[first_index],
            self.jobs[second_index],
            self._pending(first_index) or _landed(),
            self._pending(second_index) or _landed(),
        )

    def _first_ready(self, position: int) -> tuple[int, StepJob, ThreadWait]:
        """The pair at ``position``: its second job goes first if only its input is
        there; the index, job and arrival of the one that runs at ``position``."""
        order = self.order
        first, second, first_arrival, second_arrival = self._pair(position)
        if not first_arrival.ready and second_arrival.ready:
            order[position], order[position + 1] = order[position + 1], order[position]
            return order[position], second, second_arrival
        return order[position], first, first_arrival

    def _awaited(self, position: int) -> FirstOf:
        _, _, first_arrival, second_arrival = self._pair(position)
        return FirstOf(first_arrival, second_arrival)

    def _outcome(self, error: Exception | None) -> BatchOutcome:
        return BatchOutcome(
            self.results, self.started, self.seconds, error, self.waited, list(self.order)
        )


@dataclass(frozen=True, slots=True)
class StepBodies:
    """The compute-thread bodies of a rank's local steps.

    ``host_payloads``: P2P payloads must be host arrays (a transport between processes)
    or may stay framework tensors (every rank in this process); ``record``: FWDs record a
    graph (False in forward-only runs); ``zero_copy_sends``: the boundary P2P mode hands a
    FWD output over without a copy (the stage run keeps it alive until its BWD).
    """

    session: SwapDriver
    copies: CopyStream
    host_payloads: bool
    record: bool
    zero_copy_sends: bool

    def forward(
        self, stage: StageRun, micro: int, payload: Payload, target: Payload | None
    ) -> Payload:
        """FWD: the stage output as a payload (the loss as a host array on the last stage)."""
        backend, like = stage.backend, stage.device_tensor
        inputs = tensors_of(backend, payload, like)
        target_tensor = None if target is None else tensors_of(backend, target, like)
        out = stage.forward(
            micro,
            inputs,
            target_tensor,
            self.session,
            keep_output=self.zero_copy_sends,
            record=self.record,
        )
        host = self.host_payloads or stage.is_last
        return payload_of(backend, out, copy=not self.zero_copy_sends, host=host)

    def backward(
        self, stage: StageRun, micro: int, grad: Payload | None, split: bool
    ) -> Payload | None:
        """BWD / BWD_INPUT: dx as a payload (None on the first stage); the chunk is
        released unless the backend defers dw (then BWD_WEIGHT releases it)."""
        backend = stage.backend
        grad_tensor = None if grad is None else tensors_of(backend, grad, stage.device_tensor)
        dx = stage.backward(micro, grad_tensor, split=split)
        if not (split and backend.autograd.defers_weight_grads):
            self.session.release_chunk(stage.stage_index, micro)
        if dx is None:
            return None
        return payload_of(backend, dx, copy=True, host=self.host_payloads)

    def backward_weight(self, stage: StageRun, micro: int) -> None:
        """BWD_WEIGHT: dw accumulated; a deferred chunk released (its saved tensors were
        read by the dw pass)."""
        stage.backward_weight(micro)
        if stage.backend.autograd.defers_weight_grads:
            self.session.release_chunk(stage.stage_index, micro)

    def recompute(self, stage: StageRun, micro: int) -> int:
        """RECOMPUTE: the chunk's recompute-wrapped blocks run again under its FWD's
        generator states (``ppswap.swap.recompute``); how many saved tensors they made."""
        backend = stage.backend
        with stage.forward_scope():
            return self.session.recompute_chunk(
                stage.stage_index, micro, backend.module_state(stage.module)
            )

    def launch(
        self,
        step: MetaStep,
        prepare: Callable[[int, int], CopyJob],
        completion: CopyCompletion | None = None,
    ) -> CopyCompletion:
        """SWAP_LAUNCH_*: prepare the chunk's copy and launch it on the copy stream
        (``completion``: made beforehand, ``CopyStream.launch``)."""
        return self.copies.launch(step, prepare(step.stage, step.micro), completion)


class SwapDriver(StageCollector, Protocol):
    """The swap session operations the compute actor drives (compute-thread calls)."""

    def prepare_offload(self, stage: int, micro: int) -> CopyJob: ...
    def finish_offload(self, stage: int, micro: int) -> int: ...
    def prepare_load(self, stage: int, micro: int) -> CopyJob: ...
    def finish_load(self, stage: int, micro: int) -> int: ...
    def release_chunk(self, stage: int, micro: int) -> None: ...
    def recompute_chunk(self, stage: int, micro: int, parameters: Iterable[Tensor]) -> int: ...
