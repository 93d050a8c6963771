"""The compute actor: walks one rank's finalized order in batches, on one path for every run.

The actor scans its order from the current step and hands each run of consecutive
steps it can build jobs for (FWD, BWD, BWD_INPUT, BWD_WEIGHT, the four swap steps and,
with FSDP, FSDP_UNSHARD / FSDP_RESHARD and the install of gathered parameters before a
leaf) to the compute thread as one job: one thread hop for, say,
``SWAP_WAIT_LOAD -> BWD``. ``ppswap.actors.local_steps`` says which steps join a batch
(receives met on the way are posted, sends of the batch's own payloads ride along) and
``ppswap.actors.batch`` how the thread runs it. Every wait of a step is a wait on the
compute thread, inside its batch (``core.arrival``): for a received input, a launched
copy, an FSDP all-gather. It blocks the thread when the rank is alone in its process and
parks the batch when ranks share the thread (``BatchMode``); nothing waits for a step on
the event loop. The actor applies each job's result on the loop: as soon as it returns
for a job whose payload is sent (announced, ``_send_early``, so the send leaves while
the batch runs on), else with the batch's outcome; where ranks hand payloads over on the
thread (``ThreadHandoff``) nothing is announced. A batch that starts with a swap step
goes on the thread's urgent lane (``DedicatedThread.run_urgent``): in-process ranks share
the compute thread, and a copy must not start late because other ranks' leaves are
queued, as it would not on a device of its own.

- SWAP_LAUNCH_* prepares the copy on the compute thread and launches it on the rank's copy
  stream (``CopyStream.launch``) right there; SWAP_WAIT_* waits for its completion on the
  thread (the *exposed* copy wait), then finishes the state change.
- RECV_* / SEND_* are posted to the P2P actor (``send_nowait``: the channel holds every
  P2P request of the order, so posting never blocks); a receive's payload resolves a
  reply future (and its ``Arrival``) the consuming leaf reads; a send's future is awaited
  at the end.
- A composite (OVERLAP_B_F / OVERLAP_F_B) joins a batch as its two leaves; where both wait
  for their inputs, the leaf whose input comes first runs first (``LocalSteps.next_batch``,
  ``BatchRun.pairs``).
- FSDP steps are the FSDP driver's jobs (``ppswap.fsdp.driver``); after the last step its
  ``finish`` awaits the gradient reduce-scatters and installs them (one job), before a
  TIED_GRAD_SUM, which begins a batch as the two jobs of ``ppswap.actors.tie_sum``.

Every wait has a deadline (the run's step timeout, ``RunContext``); a missed deadline
raises PipelineHangError with the flight recorder's dump, naming the step the batch was
at. Any other failure raises PipelineError naming this rank, the actor and the step.

Forward-only runs (``config.forward_only``) run each FWD without recording a graph (no
backward will come) and copy every output before it is sent.

Fault injection (tests) wraps this path, never replaces it (``core.faults.ComputeFaults``):
a RAISE or DELAY rule wraps the step's body in its batch, and a batch ends before a step
with a CALL rule, whose callback runs on the loop first. ``faults=None`` costs one
``is None`` test per batch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio

from ppswap.actors.batch import (
    COMPUTE_JOB_KINDS,
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
from ppswap.actors.batch_jobs import NOT_STEPS, fsdp_job, install_job, steps_ran, tie_jobs
from ppswap.actors.batch_trace import BatchTrace
from ppswap.actors.context import RunContext
from ppswap.actors.failures import StepFailures
from ppswap.actors.handoff import ThreadHandoff
from ppswap.actors.local_steps import BatchHooks, LocalSteps, RankInputs
from ppswap.actors.mail import RankMail
from ppswap.actors.p2p import P2PChannel
from ppswap.actors.step_waits import StepWaits
from ppswap.actors.tie_sum import TieRankDriver
from ppswap.core.arrival import ArrivalTimeoutError
from ppswap.core.executor import DedicatedThread, loop_caller
from ppswap.core.faults import ComputeFaults
from ppswap.errors import PipelineError
from ppswap.events import ChunkLoaded, ChunkOffloaded, RankOrderFinished
from ppswap.fsdp.driver import FsdpRankDriver
from ppswap.logs import log_step
from ppswap.moe.runner import ExpertRunner
from ppswap.scheduler.steps import LAUNCH_OF_WAIT as _WAITS
from ppswap.scheduler.steps import SEND_RECV_KINDS as _POSTS
from ppswap.scheduler.steps import MetaStep, Order, StepKind
from ppswap.stage_run import StageRun

__all__ = ["JOB_KINDS", "BatchMode", "ComputeActor", "RankInputs", "SwapDriver"]


@dataclass(frozen=True, slots=True)
class BatchMode:
    """How a rank's batches wait on the compute thread. ``arrival_waits``: how many jobs
    of a batch may wait for a received input there (at least 1); ``parks``: the thread is
    shared (by the ranks of this process), so a batch parks rather than blocks;
    ``handoff``: those ranks hand payloads over on the thread (then no job is announced)."""

    arrival_waits: int = 1
    parks: bool = False
    handoff: ThreadHandoff | None = None


class ComputeActor:
    actor_name = "compute"

    def __init__(
        self,
        run: RunContext,
        *,
        order: Order,
        stages: Mapping[int, StageRun],
        data: RankInputs,
        bodies: StepBodies,
        compute: DedicatedThread,
        p2p: P2PChannel,
        fsdp: FsdpRankDriver | None = None,
        mode: BatchMode = BatchMode(),
        experts: ExpertRunner | None = None,
        ties: TieRankDriver | None = None,
    ) -> None:
        if mode.arrival_waits < 1:
            raise ValueError(f"mode.arrival_waits must be >= 1, got {mode.arrival_waits}")
        self.rank = rank = run.rank
        self._run = run
        self._order = order
        self._stages = stages
        self._data = data
        self._compute = compute
        self._p2p = p2p
        self._copy_stream = bodies.copies
        self._recorder = recorder = run.recorder
        self._fsdp = fsdp
        self._fsdp_finished = False
        self._experts = experts
        self._log = run.logger(self.actor_name)
        self._mode = mode
        self._errors = StepFailures(rank, self.actor_name, recorder)
        self._faults = None
        if run.faults is not None:
            note = partial(recorder.note, rank, self.actor_name)
            self._faults = ComputeFaults(run.faults, rank, note)
        self._mail = RankMail(
            p2p, self._errors.failure, arrivals=True, rank=rank, handoff=mode.handoff
        )
        # The hooks refer to the errors, not to the actor: the actor holds them (through
        # LocalSteps), and a cycle back would leave every run's actor to the collector.
        errors = self._errors
        hooks = BatchHooks(
            fsdp_job=None if fsdp is None else partial(fsdp_job, errors, fsdp),
            install=None if fsdp is None else partial(install_job, errors, fsdp),
            stops=None if self._faults is None else self._faults.stops,
            tie_jobs=None if ties is None else partial(tie_jobs, errors, ties),
        )
        self._local = LocalSteps(
            stages, data, self._mail, bodies, bodies.session, self._errors.failure, hooks
        )
        self._waits = StepWaits(compute, self._errors, run.step_timeout_s)
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
        started = time.perf_counter()
        async with self._p2p, self._expert_binding():
            await self._walk()
            if self._fsdp is not None and not self._fsdp_finished:
                await self._finish_fsdp(self._fsdp)
            self._current = "final sends"
            for future in self._mail.sends:
                await self._waits.reply(future, MetaStep(StepKind.SEND_F, -1, -1, peer=self.rank))
            self._current = None
        if self._run.events is not None:
            self._run.events.emit(
                RankOrderFinished(
                    generation=self._run.generation,
                    rank=self.rank,
                    steps_executed=self._steps_executed,
                    elapsed_s=time.perf_counter() - started,
                )
            )
        self._copy_stream.close()
        leftovers = self._mail.leftovers()
        if leftovers is not None:
            raise PipelineError(leftovers, rank=self.rank, actor=self.actor_name, step="end")

    async def _walk(self) -> None:
        order, index, faults = self._order, 0, self._faults
        while index < len(order):
            step = order[index]
            self._current = step
            if faults is not None and faults.call_before(step):
                await anyio.lowlevel.checkpoint()  # a cancellation lands before the step
            if step.kind in _POSTS:
                self._post_now(step)
                index += 1
            elif step.kind is StepKind.TIED_GRAD_SUM and self._fsdp and not self._fsdp_finished:
                await self._finish_fsdp(self._fsdp)  # a tie sums the shard gradients
            else:
                index = await self._run_batch(index)

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
        if self._run.log_steps:
            log_step(self._log, "step", step, self._run.generation)

    async def _run_batch(self, index: int) -> int:
        """Run the steps from ``index`` on as one batch; the index of the next step."""
        order = self._order
        plan, index = self._local.next_batch(
            order, index, self._post_receive, arrival_waits=self._mode.arrival_waits
        )
        if not plan.jobs:  # every step can wait on the thread: the order is wrong
            step = order[index]
            raise self._errors.failure(step, f"{step.short()} cannot run on the compute thread")
        jobs = plan.jobs
        if self._faults is not None:
            jobs = [self._faulted(self._faults, job) for job in jobs]
        if self._experts is not None:
            jobs = [self._with_experts(self._experts, job) for job in jobs]
        self._trace.expect_composites(plan.composites)
        pairs = frozenset(plan.pairs)
        if self._experts is not None:
            pairs = self._experts.batch_pairs(jobs, plan.composites, pairs, self._mode.parks)
        await self._execute(jobs, plan.posted, plan.sends, pairs)
        for composite in plan.composites:  # its leaves were jobs of the batch
            self._done(composite)
        self._trace.composites_done(plan.composites)
        return index

    def _post_receive(self, step: MetaStep, first: bool) -> None:
        """A receive met while a batch is built: posted now; traced here only ahead of the
        batch's first job (else the batch draws it after the job it follows)."""
        self._post_now(step, span=first)

    @staticmethod
    def _faulted(faults: ComputeFaults, job: StepJob) -> StepJob:
        if job.kind in NOT_STEPS:  # a rule for the step wraps the step's own job
            return job
        run = faults.wrap(job.step, job.run)
        if run is job.run:
            return job
        return StepJob(job.step, job.kind, run, job.announce, job.arrival, job.hand_offs)

    @staticmethod
    def _with_experts(experts: ExpertRunner, job: StepJob) -> StepJob:
        if job.kind not in COMPUTE_JOB_KINDS:
            return job
        run = experts.wrap(job.step, job.run)
        if run is job.run:
            return job
        return StepJob(job.step, job.kind, run, job.announce, job.arrival, job.hand_offs)

    @contextlib.asynccontextmanager
    async def _expert_binding(self) -> AsyncIterator[None]:
        """The MoE blocks of this rank's stages routed over its EP group for the order."""
        if self._experts is None:
            yield
            return
        self._experts.bind()
        try:
            yield
        finally:
            self._experts.close()

    # -- FSDP (``BatchHooks``) -----------------------------------------------------------
    async def _finish_fsdp(self, fsdp: FsdpRankDriver) -> None:
        """After the order: the gradient reduce-scatters (errors named like a step's)."""
        label = "fsdp finish"
        self._current = label
        self._fsdp_finished = True
        with self._errors.naming(label):
            self._batches += await fsdp.finish()

    # -- one batch ------------------------------------------------------------------------
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
        if sends and self._mode.handoff is None:
            # Ranks that hand payloads over on the thread (ThreadHandoff) post their
            # sends with the batch's outcome, which saves the loop a wake-up per send.
            call = loop_caller()
            announce = partial(call, self._send_early, early)
        arrivals = [job.arrival for job in jobs if job.arrival is not None]
        outcome: BatchOutcome | None = None
        timeout_s = self._waits.timeout_s
        batch = BatchRun(
            jobs,
            announce,
            self._compute.has_waiting,
            timeout_s,
            parks=self._mode.parks,
            pairs=pairs,
        )
        try:
            outcome = await self._waits.call(
                batch.at,
                batch.run,
                urgent=urgent,
                # the deadline bounds each step of the batch, not the whole: a step with
                # an arrival may wait the step deadline for it, then run
                timeout_s=timeout_s * (2 if arrivals else 1),
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
            kind = job.kind
            if kind in self._job_s:
                self._job_s[kind] += seconds
                self._jobs[kind] += 1
            if kind == "swap_finish" and job.arrival is not None:
                self._waits.exposed_copy_s += waited  # waited on the thread
                self._waited_s[job.step] = waited
            if kind in NOT_STEPS:
                continue
            if index not in early.applied:
                self._apply(job.step, result)
                self._done(job.step)
                self._post_sends(early.sends.get(index, ()))
        if recorder.keeps_spans:
            self._trace_batch(jobs, ran_indices, outcome, [(n, s) for n, s in posted if n <= ran])
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
            failed_job = jobs[outcome.job_index(ran)]
            failed = failed_job.step
            self._current = failed
            recorder.note(rank, self.actor_name, "FAILED", failed, type(outcome.error).__name__)
            if isinstance(outcome.error, ArrivalTimeoutError):
                if failed_job.arrival is not None:  # listed for the dump, as a loop wait is
                    label = failed_job.arrival.label
                    self._waits.waiting[id(failed_job)] = f"{failed.short()} waits for {label}"
                raise self._errors.hang(failed, str(outcome.error)) from outcome.error
            raise self._errors.named(failed, outcome.error)
        recorder.note(rank, self.actor_name, "end", jobs[-1].step)

    def _trace_batch(
        self,
        jobs: Sequence[StepJob],
        ran_indices: Sequence[int],
        outcome: BatchOutcome,
        posted: Sequence[tuple[int, MetaStep]],
    ) -> None:
        """The spans of the steps a batch ran (``batch_jobs.steps_ran``)."""
        steps, outcome, posted = steps_ran(jobs, ran_indices, outcome, posted)
        self._trace.batch(steps, outcome, posted)

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
        """Loop side of a finished step: where its result goes."""
        kind = step.kind
        if kind is StepKind.FWD and self._stages[step.stage].is_last:
            if self._data.outputs:
                self.outputs[step.micro] = result
            else:
                # kept where it is (a device tensor on torch): host_floats at the run's end
                self.losses[step.micro] = self._stages[step.stage].backend.keep_scalar(result)
        elif kind in _WAITS:
            waited = self._waited_s.pop(step, 0.0)
            if self._run.events is not None:
                chunk = ChunkOffloaded if kind is StepKind.SWAP_WAIT_OFFLOAD else ChunkLoaded
                self._run.events.emit(
                    chunk(
                        generation=self._run.generation,
                        rank=self.rank,
                        stage=step.stage,
                        micro=step.micro,
                        bytes=int(result),
                        waited_s=waited,
                    )
                )
            if self._run.log_steps:
                log_step(
                    self._log,
                    "swap_wait",
                    step,
                    self._run.generation,
                    bytes=result,
                    waited_s=waited,
                )
        else:
            self._mail.keep(step, result)
