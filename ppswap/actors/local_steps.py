"""LocalSteps: the compute-thread job of each local step of a rank, once it is ready.

A local step (FWD, BWD, BWD_INPUT, BWD_WEIGHT, RECOMPUTE and the four swap steps) needs no other
actor to run, only its inputs: a FWD/BWD its received payload (or the rank's own batch on
the first and last stage), a SWAP_WAIT_* the completion of the copy its launch started.
``job_if_ready`` returns the step's ``StepJob`` (taking its payload from the mail, or the
copy's completion) or None while an input is missing. ``next_batch`` scans a rank's order
for the run of such jobs the compute actor hands the thread as one batch
(``ppswap.actors.batch``): receives met on the way are posted and do not end it, nor does a
send of a payload one of its jobs makes; anything else that is not local, or is not ready,
does. With ``arrival_waits`` (the rank is alone in its process), up to that many FWD/BWD
whose received input is still on its way join the batch too, waiting for it on the
compute thread (``core.arrival``), and so does every SWAP_WAIT_* whose copy is still
running or is launched earlier in the same batch (``CopyWait``; the launch job then uses
a completion made here: a copy holds no transport resource, so these waits have no
budget). Ranks that share the thread get a budget of their whole order: their batches
park rather than block. A composite (OVERLAP_B_F) joins as its two leaves, which may run in
either order: the ready ones first, then those that wait for their input on the thread;
where both wait, the batch waits for whichever comes first and runs that leaf first
(``BatchRun.pairs``). A composite whose inputs the budget left cannot cover ends the
batch; the next one starts with it. A send's payload maker also gets the
``RankMail.hand_off`` of the send, if any. A run's ``BatchHooks`` add the rest: FSDP
steps join as the FSDP driver's jobs, each compute leaf after the job that installs its
stage's gathered parameters, a TIED_GRAD_SUM begins a batch as its two jobs (the tie
driver's), and a fault plan's callback ends a batch before its step.
Every step of an order is thus a job of some batch, or a send or receive posted on the
way. Everything here runs on the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

from ppswap.actors.batch import StepBodies, StepJob, SwapDriver, after_arrival, payload_maker
from ppswap.actors.copy_stream import CopyCompletion, CopyWait
from ppswap.actors.mail import CopyKey, RankMail
from ppswap.core.messages import HostArray, MessageKey, Payload
from ppswap.errors import PipelineError
from ppswap.scheduler.steps import (
    COMPOSITE_KINDS,
    LAUNCH_OF_WAIT,
    LOCAL_KINDS,
    TIED_GRAD_SUM,
    MetaStep,
    StepKind,
)
from ppswap.scheduler.steps import FSDP_KINDS as _FSDP_KINDS
from ppswap.scheduler.steps import RECV_KINDS as _RECVS
from ppswap.scheduler.steps import RUNS_MODULE_KINDS as RUNS_MODULE
from ppswap.scheduler.steps import SEND_KINDS as _SENDS
from ppswap.stage_run import StageRun

__all__ = [
    "ARRIVAL_WAITS_PER_BATCH",
    "BatchHooks",
    "BatchPlan",
    "LocalSteps",
    "RankInputs",
]

ARRIVAL_WAITS_PER_BATCH = 4
"""At most this many jobs of a batch wait for their received input on the compute thread:
a batch posts the receives it meets, and a gloo receive in flight holds a waiting thread
and a header buffer, so the batch does not run arbitrarily far ahead of its inputs."""
_JOB_OF_BACKWARD = {StepKind.BWD: "backward", StepKind.BWD_INPUT: "backward_input"}


@dataclass(frozen=True, slots=True)
class RankInputs:
    """The micro-batches this rank's first/last stages consume (host arrays; a tuple of
    them per micro-batch for inputs or targets given as a tuple); ``outputs``: the last
    stage's outputs are the run's result (a forward-only run without ``loss_fn``: no
    targets)."""

    inputs: Sequence[HostArray] | Sequence[tuple[HostArray, ...]]
    targets: Sequence[HostArray] | Sequence[tuple[HostArray, ...]] | None
    outputs: bool = False


@dataclass(frozen=True, slots=True)
class BatchHooks:
    """What a run adds to its batches, beside its local steps: ``fsdp_job(step)``, the
    job of an FSDP_UNSHARD / FSDP_RESHARD (the FSDP driver's); ``install(leaf)``, a job
    that must run before compute leaf ``leaf`` (the install of its stage's gathered
    parameters) or None; ``stops(step)``: the batch ends before ``step`` (a fault plan's
    callback at it runs on the event loop first); ``tie_jobs(step)``, the jobs of a
    TIED_GRAD_SUM (``ppswap.actors.tie_sum``). Each may raise for a step the order
    cannot run."""

    fsdp_job: Callable[[MetaStep], StepJob] | None = None
    install: Callable[[MetaStep], StepJob | None] | None = None
    stops: Callable[[MetaStep], bool] | None = None
    tie_jobs: Callable[[MetaStep], Sequence[StepJob]] | None = None


@dataclass(slots=True)
class BatchPlan:
    """The next batch of a rank's order (``LocalSteps.next_batch``): its ``jobs``; the
    receives and sends ``posted`` after the n-th job, as ``(n, step)``; by the index of
    the job that makes the payload, the ``sends`` of it (posted as soon as it is made); the
    ``composites`` whose leaves are among the jobs, and the ``pairs`` of those whose leaves
    both wait (``BatchRun.pairs``). No jobs: the step at the returned index is not ready
    (or not local)."""

    jobs: list[StepJob] = field(default_factory=list)
    posted: list[tuple[int, MetaStep]] = field(default_factory=list)
    sends: dict[int, list[MetaStep]] = field(default_factory=dict)
    composites: list[MetaStep] = field(default_factory=list)
    pairs: set[int] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class LocalSteps:
    """Jobs of a rank's local steps (module docstring). ``failure(step, message)`` makes
    the error for an order that cannot run (a wait for a copy never launched)."""

    stages: Mapping[int, StageRun]
    data: RankInputs
    mail: RankMail
    bodies: StepBodies
    session: SwapDriver
    failure: Callable[[MetaStep, str], PipelineError]
    hooks: BatchHooks = BatchHooks()

    def job_if_ready(
        self,
        step: MetaStep,
        launched: dict[CopyKey, CopyCompletion | None],
        *,
        wait: bool = False,
        wait_copy: bool = False,
    ) -> StepJob | None:
        """The compute-thread job of a local step, or None while its inputs are not
        there (``launched``: copies launched earlier in the batch being built, with the
        completion their launch will use; ``wait``: a FWD/BWD whose receive has an
        ``Arrival`` gets a job that waits for it; ``wait_copy``: a SWAP_WAIT_* whose
        launched copy is still running, or is launched earlier in the same batch, gets a
        job that waits for it)."""
        kind = step.kind
        if kind is StepKind.FWD:
            return self._forward(step, wait)
        if kind is StepKind.BWD or kind is StepKind.BWD_INPUT:
            return self._backward(step, wait)
        if kind is StepKind.BWD_WEIGHT:
            stage = self.stages[step.stage]
            body = partial(self.bodies.backward_weight, stage, step.micro)
            return StepJob(step, "backward_weight", body)
        if kind is StepKind.RECOMPUTE:
            stage = self.stages[step.stage]
            return StepJob(step, "recompute", partial(self.bodies.recompute, stage, step.micro))
        if kind is StepKind.SWAP_LAUNCH_OFFLOAD or kind is StepKind.SWAP_LAUNCH_LOAD:
            # Made here, so that a SWAP_WAIT_* later in the same batch can wait for it.
            label = f"copy {step.short()} (not launched yet)"  # renamed at the launch
            completion = CopyCompletion(label) if wait_copy else None
            launched[(kind, step.stage, step.micro)] = completion
            prepare = (
                self.session.prepare_offload
                if kind is StepKind.SWAP_LAUNCH_OFFLOAD
                else self.session.prepare_load
            )
            launch = partial(self.bodies.launch, step, prepare, completion)
            return StepJob(step, "swap_prepare", launch)
        return self._swap_wait(step, launched, wait_copy)

    def next_batch(
        self,
        order: Sequence[MetaStep],
        index: int,
        post_receive: Callable[[MetaStep, bool], None],
        *,
        arrival_waits: int = 0,
    ) -> tuple[BatchPlan, int]:
        """The batch of ready local steps from ``order[index]`` on (module docstring), and
        the index of the next step to look at. A receive met on the way is posted at once,
        ``post_receive(step, first)`` (``first``: before the batch's first job). FSDP
        steps join as the jobs of ``hooks.fsdp_job``, and every compute leaf is preceded
        by the job ``hooks.install`` gives for it, if any. ``arrival_waits``: how many
        jobs may wait for their received input on the thread."""
        plan = BatchPlan()
        jobs = plan.jobs
        launched: dict[CopyKey, CopyCompletion | None] = {}
        waits_left = arrival_waits
        fsdp_job, install, stops = self.hooks.fsdp_job, self.hooks.install, self.hooks.stops
        start = index
        while index < len(order):
            step = order[index]
            if stops is not None and index > start and stops(step):
                break
            if step.kind in _RECVS:
                post_receive(step, not jobs)
                if jobs:
                    plan.posted.append((len(jobs), step))
                index += 1
                continue
            if step.kind in _SENDS:
                producer = payload_maker(jobs, step)
                if producer is None:
                    break
                maker = jobs[producer]
                hand_off = self.mail.hand_off(step)
                hand_offs = maker.hand_offs if hand_off is None else (*maker.hand_offs, hand_off)
                jobs[producer] = StepJob(  # not dataclasses.replace: 10 us a call
                    maker.step,
                    maker.kind,
                    maker.run,
                    announce=True,
                    arrival=maker.arrival,
                    hand_offs=hand_offs,
                )
                plan.sends.setdefault(producer, []).append(step)
                plan.posted.append((producer + 1, step))
                index += 1
                continue
            if step.kind in COMPOSITE_KINDS:
                leaves = self._composite_jobs(step, launched, waits_left)
                if leaves is None:
                    break
                if install is not None:
                    jobs.extend(j for leaf in step.sub_steps if (j := install(leaf)) is not None)
                waits = sum(job.arrival is not None for job in leaves)
                if waits == len(leaves):
                    plan.pairs.add(len(jobs))
                waits_left -= waits
                jobs.extend(leaves)
                plan.composites.append(step)
                index += 1
                continue
            if step.kind is TIED_GRAD_SUM:
                if jobs:  # it begins its batch: the rank's FSDP gradients come first
                    break
                if self.hooks.tie_jobs is None:
                    raise self.failure(
                        step, "the order has a TIED_GRAD_SUM but this rank holds no tie"
                    )
                jobs.extend(self.hooks.tie_jobs(step))
                index += 1
                continue
            if step.kind in _FSDP_KINDS:
                if fsdp_job is None:
                    raise self.failure(
                        step,
                        "the order has FSDP steps but no stage of this rank is fully_shard()-ed",
                    )
                jobs.append(fsdp_job(step))
                index += 1
                continue
            if step.kind not in LOCAL_KINDS:
                break
            job = self.job_if_ready(
                step, launched, wait=waits_left > 0, wait_copy=arrival_waits > 0
            )
            if job is None:
                break
            if install is not None and step.kind in RUNS_MODULE and (pre := install(step)):
                jobs.append(pre)
            if job.arrival is not None and job.kind != "swap_finish":
                waits_left -= 1
            jobs.append(job)
            index += 1
        return plan, index

    def _composite_jobs(
        self, step: MetaStep, launched: dict[CopyKey, CopyCompletion | None], waits_left: int
    ) -> list[StepJob] | None:
        """The jobs of a composite's two leaves, or None (the budget left does not cover
        them: the composite begins the next batch). Its leaves may run in either
        order, so a batch takes them when both are ready (in the composite's order), when
        one is and the other may wait for its input on the thread (the ready one first,
        as two tasks would run them), or when both may wait (a pair: whichever input
        comes first is used first). Readiness is read without taking any payload, so a
        composite left out of the batch finds its inputs where they were."""
        ready = [leaf for leaf in step.sub_steps if self._input_arrived(leaf)]
        waiting = [leaf for leaf in step.sub_steps if leaf not in ready]
        if len(waiting) > waits_left or not all(self._may_wait(leaf) for leaf in waiting):
            return None
        jobs = [self._ready_job(leaf, launched) for leaf in ready]
        for leaf in waiting:
            late = self.job_if_ready(leaf, launched, wait=True)
            assert late is not None and late.arrival is not None
            jobs.append(late)
        return jobs

    def _ready_job(self, step: MetaStep, launched: dict[CopyKey, CopyCompletion | None]) -> StepJob:
        job = self.job_if_ready(step, launched)
        assert job is not None, f"{step.short()} was ready"
        return job

    def received_input(self, step: MetaStep) -> MessageKey | None:
        """The message a local step consumes: a FWD's or BWD's received input, None where
        it reads its rank's own data (first / last stage) and for any other step."""
        stage = self.stages[step.stage]
        if step.kind is StepKind.FWD:
            return None if stage.is_first else MessageKey("F", step.stage, step.micro)
        if step.kind is StepKind.BWD or step.kind is StepKind.BWD_INPUT:
            return None if stage.is_last else MessageKey("B", step.stage, step.micro)
        return None

    def _input_arrived(self, step: MetaStep) -> bool:
        key = self.received_input(step)
        return key is None or self.mail.received(key, step).done

    def _may_wait(self, step: MetaStep) -> bool:
        key = self.received_input(step)
        return key is not None and self.mail.received(key, step).arrival is not None

    def _swap_wait(
        self, step: MetaStep, launched: dict[CopyKey, CopyCompletion | None], wait_copy: bool
    ) -> StepJob | None:
        launch_key = (LAUNCH_OF_WAIT[step.kind], step.stage, step.micro)
        copies = self.mail.copies
        completion = copies.get(launch_key)
        in_batch = completion is None  # launched by a job of the batch being built
        if completion is None:
            if launch_key not in launched:
                raise self.failure(step, f"{step.short()} waits for a copy that was never launched")
            completion = launched[launch_key]
            if completion is None:  # no wait on the thread: after the launch's batch
                return None
        copy_wait = None
        if not completion.is_set():
            if not wait_copy:
                return None
            copy_wait = CopyWait(completion)
            self.mail.copy_on_thread(completion)
        elif completion.error is not None:
            raise completion.error
        if in_batch:
            self.mail.launched_in_batch.add(launch_key)  # its launch's result stays out
        else:
            del copies[launch_key]
        finish = (
            self.session.finish_offload
            if step.kind is StepKind.SWAP_WAIT_OFFLOAD
            else self.session.finish_load
        )
        body = partial(finish, step.stage, step.micro)
        return StepJob(step, "swap_finish", body, arrival=copy_wait)

    def _forward(self, step: MetaStep, wait: bool) -> StepJob | None:
        stage = self.stages[step.stage]
        target = None
        if stage.is_last and not self.data.outputs:
            assert self.data.targets is not None
            target = self.data.targets[step.micro]
        payload: Payload = None
        key = self.received_input(step)
        if key is None:
            payload = self.data.inputs[step.micro]
        else:
            arrived, payload = self.mail.take(key, step)
            if not arrived:
                arrival = self.mail.take_arrival(key, step) if wait else None
                if arrival is None:
                    return None
                forward = partial(self.bodies.forward, stage, step.micro)
                body = partial(after_arrival, arrival, forward, target)
                return StepJob(step, "forward", body, arrival=arrival)
        body = partial(self.bodies.forward, stage, step.micro, payload, target)
        return StepJob(step, "forward", body)

    def _backward(self, step: MetaStep, wait: bool) -> StepJob | None:
        stage = self.stages[step.stage]
        split = step.kind is StepKind.BWD_INPUT
        kind = _JOB_OF_BACKWARD[step.kind]
        grad: Payload = None
        key = self.received_input(step)
        if key is not None:
            arrived, grad = self.mail.take(key, step)
            if not arrived:
                arrival = self.mail.take_arrival(key, step) if wait else None
                if arrival is None:
                    return None
                backward = partial(self.bodies.backward, stage, step.micro)
                body = partial(after_arrival, arrival, backward, split)
                return StepJob(step, kind, body, arrival=arrival)
        body = partial(self.bodies.backward, stage, step.micro, grad, split)
        return StepJob(step, kind, body)
