"""The compute actor: walks one rank's finalized order.

Batches (the hot path). The actor scans its order from the current step and hands each
run of consecutive ready *local* steps (FWD, BWD, BWD_INPUT, BWD_WEIGHT and the four swap
steps) to the compute thread as one job: one thread hop for, say,
``SWAP_WAIT_LOAD -> BWD``. ``ppswap.actors.local_steps`` says which steps join a batch
(receives met on the way are posted, sends of the batch's own payloads ride along, inputs
still on their way are waited for on the thread) and ``ppswap.actors.batch`` how the
thread runs it (blocking on those inputs when the rank is alone in its process, parking
when ranks share the thread). The actor applies each job's result on the loop: as soon as
it returns for a job whose payload is sent (announced, ``_send_early``, so the send
leaves while the batch runs on), else with the batch's outcome; where ranks share the
thread the payload is handed over on it (``ThreadHandoff``) and nothing is announced.
When the first local step is not ready the actor waits for it (with the step deadline);
the time blocked at a SWAP_WAIT_* is the *exposed* copy wait. A batch that starts with a
swap step goes on the thread's urgent lane (``DedicatedThread.run_urgent``): in-process
ranks share the compute thread, and a copy must not start late because other ranks'
leaves are queued, as it would not on a device of its own.

- SWAP_LAUNCH_* prepares the copy on the compute thread and launches it on the rank's copy
  stream (``CopyStream.launch``) right there; SWAP_WAIT_* awaits its completion event,
  then finishes the state change on the compute thread.
- RECV_* / SEND_* are posted to the P2P actor (``send_nowait``: the channel holds every
  P2P request of the order, so posting never blocks); a receive's payload resolves a
  reply future the consuming leaf reads; a send's future is awaited at the end.
- A composite (OVERLAP_B_F / OVERLAP_F_B) joins a batch as its two leaves; where both wait
  for their inputs, the leaf whose input comes first runs first (``LocalSteps.next_batch``,
  ``BatchRun.pairs``). Where its inputs cannot be waited for
  on the thread (FSDP, a fault plan, the wait budget spent) it runs its two leaves as
  tasks of a nested task group and returns when both are done: a leaf waiting for its
  receive does not hold up the other.
- FSDP_* steps are handed to the optional FSDP driver, which also gets a call before every
  compute leaf (``before_compute``: an all-gather issued by FSDP_UNSHARD is awaited and
  installed there, so it overlaps the compute in between) and one after the last step
  (``finish``: the gradient reduce-scatters are awaited and installed). With FSDP a batch
  holds at most one leaf, its first.

Every wait has a deadline (``timeout_s``, ``ppswap.actors.step_waits``); a missed deadline
raises PipelineHangError with the flight recorder's dump. Any other failure raises
PipelineError naming this rank, the actor and the step.

Forward-only runs (``config.forward_only``) run each FWD without recording a graph (no
backward will come) and copy every output before it is sent.

Fault injection (tests): with a ``FaultPlan`` the actor runs every step on its own, and
consults the plan before it (top-level or a composite's leaf); ``faults=None`` costs one
``is None`` test.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from functools import partial
from typing import Any, ClassVar, Protocol

import anyio
import structlog

from ppswap.actors.batch import (
    JOB_KINDS,
    SWAP_JOB_KINDS,
    BatchOutcome,
    BatchRun,
    ComputeStats,
    EarlySends,
    StepBodies,
    StepJob,
    SwapDriver,
)
from ppswap.actors.batch_trace import BatchTrace
from ppswap.actors.copy_stream import CopyStream
from ppswap.actors.failures import StepFailures
from ppswap.actors.handoff import ThreadHandoff
from ppswap.actors.local_steps import LocalSteps, RankInputs
from ppswap.actors.mail import RankMail
from ppswap.actors.p2p import P2PChannel
from ppswap.actors.step_waits import StepWaits
from ppswap.actors.trace import FlightRecorder
from ppswap.core.arrival import ArrivalTimeoutError
from ppswap.core.executor import DedicatedThread, loop_caller
from ppswap.core.faults import FaultAction, FaultPlan, FaultSite
from ppswap.errors import (
    PipelineError,
    first_pipeline_error,
)
from ppswap.logs import log_step
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import COMPOSITE_KINDS, LOCAL_KINDS, MetaStep, Order, StepKind
from ppswap.scheduler.steps import COMPUTE_KINDS as LEAVES
from ppswap.scheduler.steps import LAUNCH_OF_WAIT as _WAITS
from ppswap.scheduler.steps import SEND_RECV_KINDS as _POSTS
from ppswap.stage import PipelineStage

__all__ = ["JOB_KINDS", "ComputeActor", "FsdpDriver", "RankInputs", "SwapDriver"]


class FsdpDriver(Protocol):
    """Runs FSDP_UNSHARD / FSDP_RESHARD for this rank's stages (``ppswap.fsdp``)."""

    async def run_step(self, step: MetaStep) -> None: ...
    async def before_compute(self, step: MetaStep) -> None: ...
    async def finish(self) -> None: ...


class ComputeActor:
    actor_name = "compute"

    def __init__(
        self,
        *,
        rank: int,
        order: Order,
        config: ScheduleConfig,
        stages: Mapping[int, PipelineStage],
        compute: DedicatedThread,
        session: SwapDriver,
        p2p: P2PChannel,
        copies: CopyStream,
        recorder: FlightRecorder,
        data: RankInputs,
        generation: int,
        timeout_s: float = math.inf,
        fsdp: FsdpDriver | None = None,
        log_steps: bool = False,
        faults: FaultPlan | None = None,
        host_payloads: bool = True,
        arrival_waits: int = 0,
        handoff: ThreadHandoff | None = None,
    ) -> None:
        self.rank = rank
        self._order = order
        self._stages = stages
        self._compute = compute
        self._session = session
        self._p2p = p2p
        self._copy_stream = copies
        self._recorder = recorder
        self._data = data
        self._generation = generation
        self._fsdp = fsdp
        self._log_steps = log_steps
        self._log = structlog.get_logger("ppswap").bind(rank=rank, actor=self.actor_name)
        record = not config.forward_only
        bodies = StepBodies(
            session,
            copies,
            host_payloads=host_payloads,
            record=record,
            # A forward-only output is not kept by the stage, so it is always copied.
            zero_copy_sends=config.p2p == "boundary" and record,
        )
        self._faults = faults
        self._errors = StepFailures(rank, self.actor_name, recorder)
        self._arrival_waits = arrival_waits
        # Ranks that share the thread (and so hand payloads over on it) park their batches.
        self._parks = handoff is not None
        self._mail = RankMail(
            p2p, self._errors.failure, arrivals=arrival_waits > 0, rank=rank, handoff=handoff
        )
        self._local = LocalSteps(stages, data, self._mail, bodies, session, self._errors.failure)
        self._waits = StepWaits(compute, self._errors, timeout_s)
        self._waited_s: dict[MetaStep, float] = {}  # a SWAP_WAIT's exposed wait, for its log
        self._trace = BatchTrace(recorder, rank, self.actor_name)
        self.losses: dict[int, Any] = {}  # Backend.keep_scalar of each micro-batch's loss
        self.outputs: dict[int, Any] = {}  # the last stage's, where they are the result
        self._steps_executed = 0
        self._batches = 0
        self._job_s = dict.fromkeys(JOB_KINDS, 0.0)
        self._jobs = dict.fromkeys(JOB_KINDS, 0)
        self._current: MetaStep | str | None = None
        recorder.register_pending(rank, self.actor_name, self._pending)

    def stats(self) -> ComputeStats:
        return ComputeStats(
            self._steps_executed,
            self._waits.exposed_copy_s,
            dict(self._job_s),
            dict(self._jobs),
            self._batches,
        )

    def _pending(self) -> list[str]:
        current = self._current
        items = [f"at {current.short() if isinstance(current, MetaStep) else current}"]
        items = items if current is not None else []
        items.append(f"{self._steps_executed} of {len(self._order)} steps done")
        items += sorted(self._waits.waiting.values())
        items += self._mail.pending()
        return items

    # -- the walk -----------------------------------------------------------------------
    async def run(self) -> None:
        """Execute the order, then wait for the sends still in flight; close the P2P
        channel and the copy stream."""
        async with self._p2p:
            await self._walk()
            if self._fsdp is not None:
                await self._finish_fsdp(self._fsdp)
            self._current = "final sends"
            for future in self._mail.sends:
                await self._waits.reply(future, MetaStep(StepKind.SEND_F, -1, -1, peer=self.rank))
            self._current = None
        self._copy_stream.close()
        leftovers = self._mail.leftovers()
        if leftovers is not None:
            raise PipelineError(leftovers, rank=self.rank, actor=self.actor_name, step="end")

    async def _walk(self) -> None:
        order, index = self._order, 0
        fast = self._faults is None
        while index < len(order):
            step = order[index]
            self._current = step
            if fast and step.kind in _POSTS:
                self._post_now(step)
                index += 1
            elif fast and (step.kind in LOCAL_KINDS or step.kind in COMPOSITE_KINDS):
                index = await self._run_local(index)
            else:
                await self._run_step(step)
                self._steps_executed += 1
                index += 1

    def _post_now(self, step: MetaStep, *, span: bool = True) -> None:
        """A top-level send or receive step, posted (it counts as executed at once).
        ``span=False``: its trace span is added later, by the batch it was posted ahead of
        (the trace shows the order, not the early post)."""
        started = self._recorder.now_us()
        self._mail.post(step)
        self._done(step)
        if span and self._recorder.keeps_spans:
            self._recorder.add_span(self.rank, self.actor_name, step.short(), started)

    def _done(self, step: MetaStep) -> None:
        self._steps_executed += 1
        if self._log_steps:
            log_step(self._log, "step", step, self._generation)

    async def _run_local(self, index: int) -> int:
        """Run the ready local steps from ``index`` as one batch (or wait for the first
        one); return the index of the next step to look at."""
        order, fsdp = self._order, self._fsdp
        plan, index = self._local.next_batch(
            order,
            index,
            self._post_receive,
            one_leaf=fsdp is not None,
            arrival_waits=self._arrival_waits,
        )
        if not plan.jobs:
            if index < len(order) and order[index].kind in LOCAL_KINDS:
                self._current = order[index]
                await self._until_ready(order[index])
            elif index < len(order) and order[index].kind in COMPOSITE_KINDS:
                self._current = order[index]
                await self._run_step(order[index])  # its leaves as two tasks
                self._steps_executed += 1
                index += 1
            return index
        if fsdp is not None and plan.jobs[0].step.kind in LEAVES:
            await fsdp.before_compute(plan.jobs[0].step)
        self._trace.expect_composites(plan.composites)
        await self._execute(plan.jobs, plan.posted, plan.sends, frozenset(plan.pairs))
        for composite in plan.composites:  # its leaves were jobs of the batch
            self._done(composite)
        self._trace.composites_done(plan.composites)
        return index

    def _post_receive(self, step: MetaStep, first: bool) -> None:
        """A receive met while a batch is built: posted now; traced here only ahead of the
        batch's first job (else the batch draws it after the job it follows)."""
        self._post_now(step, span=first)

    # -- waiting for a local step's inputs -------------------------------------------------
    async def _until_ready(self, step: MetaStep) -> None:
        """Wait for what the local ``step`` needs (a received payload, a copy)."""
        kind = step.kind
        if kind in _WAITS:
            completion = self._mail.copies.get((_WAITS[kind], step.stage, step.micro))
            if completion is not None:
                self._waited_s[step] = await self._waits.copy(completion, step)
            return
        key = self._local.received_input(step)
        future = None if key is None else self._mail.recvs.get(key)
        if future is not None:
            await self._waits.reply(future, step)

    async def _execute(
        self,
        jobs: list[StepJob],
        posted: Sequence[tuple[int, MetaStep]] = (),
        sends: Mapping[int, list[MetaStep]] | None = None,
        pairs: frozenset[int] = frozenset(),
    ) -> None:
        """Run ``jobs`` as one compute-thread batch and apply their results in the order
        they ran (``posted``: receives and sends posted after the n-th job, traced after
        it; ``sends``: by job index, the sends of the payload that job makes, posted as
        soon as it is made; ``pairs``: as ``BatchRun``'s)."""
        urgent = jobs[0].kind in SWAP_JOB_KINDS
        recorder, rank = self._recorder, self.rank
        recorder.note(rank, self.actor_name, "begin", jobs[0].step, len(jobs))
        early = EarlySends(jobs, sends or {})
        announce = None
        if sends and not self._parks:
            # Ranks that share the thread hand payloads over on it (ThreadHandoff), and
            # none of their waits is on the loop (``_local_step``): their sends are posted
            # with the batch's outcome, which saves the loop a wake-up per send.
            call = loop_caller()
            announce = partial(call, self._send_early, early)
        arrivals = [job.arrival for job in jobs if job.arrival is not None]
        outcome: BatchOutcome | None = None
        batch = BatchRun(
            jobs,
            announce,
            self._compute.has_waiting,
            self._waits.timeout_s,
            parks=self._parks,
            pairs=pairs,
        )
        try:
            outcome = await self._waits.call(
                self._current,
                batch.run,
                urgent=urgent,
                # the deadline bounds each step of the batch, not the whole: a step with
                # an arrival may wait the step deadline for it, then run
                timeout_s=self._waits.timeout_s * (2 if arrivals else 1),
                progress=partial(batch.progress, rank),
            )
        finally:
            early.open = False  # an announcement still queued is dropped
            if outcome is None:  # cancelled or failed: free a thread blocked on an arrival
                for arrival in arrivals:
                    arrival.abandon("the run stopped while the compute thread waited for it")
        self._batches += 1
        ran = len(outcome.results)
        ran_indices = [outcome.job_index(n) for n in range(ran)]
        for index, result, seconds, waited in zip(
            ran_indices, outcome.results, outcome.seconds, outcome.waited, strict=True
        ):
            job = jobs[index]
            self._job_s[job.kind] += seconds
            self._jobs[job.kind] += 1
            if job.kind == "swap_finish" and job.arrival is not None:
                self._waits.exposed_copy_s += waited  # waited on the thread
                self._waited_s[job.step] = waited
            if index not in early.applied:
                self._apply(job.step, result)
                self._done(job.step)
                self._post_sends(early.sends.get(index, ()))
        if recorder.keeps_spans:
            steps = [jobs[index].step for index in ran_indices]
            self._trace.batch(steps, outcome, [(n, s) for n, s in posted if n <= ran])
        if early.error is not None:
            raise early.error
        if outcome.error is None and ran < len(jobs):  # the batch yielded the thread
            left = [outcome.job_index(n) for n in range(ran, len(jobs))]  # no pair is split
            rest = {i: early.sends[index] for i, index in enumerate(left) if index in early.sends}
            later = [(n - ran, s) for n, s in posted if n > ran]
            await self._execute(
                [jobs[i] for i in left], later, rest, frozenset(p - ran for p in pairs if p >= ran)
            )
            return
        if outcome.error is not None:
            failed = jobs[outcome.job_index(ran)].step
            self._current = failed
            recorder.note(rank, self.actor_name, "FAILED", failed, type(outcome.error).__name__)
            if isinstance(outcome.error, ArrivalTimeoutError):
                raise self._errors.hang(failed, str(outcome.error)) from outcome.error
            raise self._errors.named(failed, outcome.error)
        recorder.note(rank, self.actor_name, "end", jobs[-1].step)

    def _send_early(self, early: EarlySends, index: int, result: Any) -> None:
        """Event loop, while the batch still runs: apply the announced job's result and
        post the sends of its payload. An error is kept for ``_execute`` to raise."""
        if not early.open or early.error is not None:
            return
        step = early.jobs[index].step
        try:
            self._apply(step, result)
            self._done(step)
            early.applied.add(index)
            self._post_sends(early.sends[index])
        except Exception as exc:  # a PipelineError is kept as it is
            early.error = self._errors.named(step, exc)

    def _post_sends(self, sends: Sequence[MetaStep]) -> None:
        """Post the sends of a payload a job made (errors name the send)."""
        for send in sends:
            try:
                self._mail.post(send)
            except PipelineError:
                raise
            except Exception as exc:
                raise self._errors.named(send, exc) from exc
            self._done(send)

    def _apply(self, step: MetaStep, result: Any) -> None:
        """Loop side of a finished local step: where its result goes."""
        kind = step.kind
        if kind is StepKind.FWD and self._stages[step.stage].is_last:
            if self._data.outputs:
                self.outputs[step.micro] = result
            else:
                # kept where it is (a device tensor on torch): host_floats at the run's end
                self.losses[step.micro] = self._stages[step.stage].backend.keep_scalar(result)
        elif kind in _WAITS:
            waited = self._waited_s.pop(step, 0.0)
            if self._log_steps:
                log_step(
                    self._log, "swap_wait", step, self._generation, bytes=result, waited_s=waited
                )
        else:
            self._mail.keep(step, result)

    # -- one step at a time (fault plans, composites, FSDP steps) -------------------------
    async def _run_step(self, step: MetaStep) -> None:
        """Run one step (top-level or a composite's leaf); failures name this step."""
        with self._errors.naming(step.short()):
            if self._log_steps:
                log_step(self._log, "step", step, self._generation)
            if self._faults is not None:
                await self._inject(self._faults, step)
            handler = self._handlers.get(step.kind)
            if handler is None:
                raise self._errors.failure(step, f"no handler for {step.kind.value}")
            await handler(self, step)

    async def _local_step(self, step: MetaStep) -> None:
        # A rank that parks waits for its input on the thread here too: its peers post
        # their sends only with their batches' outcomes, so the loop may hear of the
        # payload late, while the handoff has it on the thread already.
        job = self._local.job_if_ready(step, {}, wait=self._parks, wait_copy=self._parks)
        while job is None:
            await self._until_ready(step)
            job = self._local.job_if_ready(step, {})
        if self._fsdp is not None and step.kind in LEAVES:
            await self._fsdp.before_compute(step)
        await self._execute([job])

    async def _post_step(self, step: MetaStep) -> None:
        self._mail.post(step)

    async def _composite(self, step: MetaStep) -> None:
        try:
            async with anyio.create_task_group() as tg:
                for leaf in step.sub_steps:
                    tg.start_soon(self._run_step, leaf)
        except BaseExceptionGroup as group:
            # Report the leaf that failed first, not the composite around it.
            raise first_pipeline_error(group) from group

    async def _fsdp_step(self, step: MetaStep) -> None:
        if self._fsdp is None:
            raise self._errors.failure(
                step, "the order has FSDP steps but no stage of this rank is fully_shard()-ed"
            )
        await self._fsdp.run_step(step)

    async def _finish_fsdp(self, fsdp: FsdpDriver) -> None:
        """After the order: the gradient reduce-scatters (errors named like a step's)."""
        label = "fsdp finish"
        self._current = label
        with self._errors.naming(label):
            await fsdp.finish()

    async def _inject(self, faults: FaultPlan, step: MetaStep) -> None:
        """Apply the plan's compute rule for ``step``: raise or stall on the compute thread
        (the path a framework failure or a stuck kernel takes), or run a callback here."""
        rule = faults.match(FaultSite.COMPUTE, self.rank, step)
        if rule is None:
            return
        self._recorder.note(self.rank, self.actor_name, rule.describe(self.rank, step))
        if rule.action is FaultAction.RAISE:
            await self._waits.call(self._current, rule.raise_fault, self.rank, step)
        elif rule.action is FaultAction.DELAY:
            await self._waits.call(self._current, time.sleep, rule.delay_s)
        elif rule.callback is not None:
            rule.callback()

    _handlers: ClassVar[dict[StepKind, Callable[[ComputeActor, MetaStep], Awaitable[None]]]] = {
        **dict.fromkeys(LOCAL_KINDS, _local_step),
        **dict.fromkeys(_POSTS, _post_step),
        StepKind.OVERLAP_B_F: _composite,
        StepKind.OVERLAP_F_B: _composite,
        StepKind.FSDP_UNSHARD: _fsdp_step,
        StepKind.FSDP_RESHARD: _fsdp_step,
    }
