"""``run_schedule``: plan, wire and run the actors of every local rank; collect the result.

One run, start to end:

1. ``RunOptions`` checks every option; the planner (``ppswap.planning.prepare``) checks the
   stages and the data against them and builds the finalized, validated per-rank orders.
   Nothing has run yet when a bad input is refused.
2. Inside the stages' backend's run scope, the process's single compute thread starts,
   then one task group holding, per local rank (``RankRuntime``), a compute actor, a
   copy-stream actor (its own copy thread) and a P2P actor. The compute actor closes its
   P2P channel and its copy stream when its order is done; the other two drain and exit,
   the task group joins.
3. On success every swap session is closed (every group gone). On failure or cancellation
   the task group cancels every actor, the copy actors finish the copy in flight, and the
   sessions and stages are torn down on the compute thread (shielded, bounded), so the
   same stages can run again. The error leaves as one ``PipelineError`` naming rank,
   actor and step.

Reliability (docs/reliability.md): every wait has the deadline ``step_timeout``
(``DEFAULT_STEP_TIMEOUT_S``); a missed one is a ``PipelineHangError`` carrying the flight
recorder's dump (per actor the last events and pending futures, every channel's
statistics, the compute thread's current job, the transport's counters). Cancelling the
awaiting task tears the run down like a failure and re-raises the cancellation. The
teardown also drops the framework's records of forwards whose backward never ran
(``backend.autograd.discard_all``): they would otherwise stay in the process for good.
"""

from __future__ import annotations

import enum
import math
import threading
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import structlog

from ppswap.actors.compute import ComputeActor
from ppswap.actors.handoff import ThreadHandoff
from ppswap.actors.p2p import InProcessTransport
from ppswap.actors.rank import RankRuntime
from ppswap.actors.tie_sum import TieSums, grads_to_give
from ppswap.actors.trace import FlightRecorder
from ppswap.backends.base import CopyEngine
from ppswap.core.executor import DedicatedThread
from ppswap.core.faults import FaultSite
from ppswap.core.transport import Transport, is_distributed, is_immediate
from ppswap.errors import first_pipeline_error
from ppswap.events import (
    RunCancelled,
    RunEvents,
    RunFailed,
    RunFinished,
    RunStarted,
    TimelineSpan,
)
from ppswap.fsdp.plan import param_storage_bytes
from ppswap.options import DEFAULT_STEP_TIMEOUT_S, RunOptions
from ppswap.planning.data import Batches
from ppswap.planning.prepare import RunPlan, prepare_run, split_batches, with_tie_steps
from ppswap.planning.ties import resolve_ties
from ppswap.results import RankStats, RunResult
from ppswap.stage import LossFn, PipelineStage
from ppswap.stage_run import StageRun, StageRuns
from ppswap.swap.unmarked import warn_if_nothing_swapped
from ppswap.transports.distributed import abort_job, configure_transport, gather_results

__all__ = ["DEFAULT_STEP_TIMEOUT_S", "RankStats", "RunResult", "run_schedule"]

_TEARDOWN_TIMEOUT_S = 60.0

# One run at a time per process: MindSpore autograd must see a single compute thread.
_RUN_LOCK = threading.Lock()


@asynccontextmanager
async def _exclusive_run() -> AsyncIterator[None]:
    if not _RUN_LOCK.acquire(blocking=False):
        raise RuntimeError(
            "another ppswap run is active in this process; runs share the single "
            "compute thread, so run them one after another"
        )
    try:
        yield
    finally:
        _RUN_LOCK.release()


class _Unset(enum.Enum):
    """The type of ``UNSET``: an argument that was not given."""

    TOKEN = 0


UNSET = _Unset.TOKEN


async def run_schedule(
    stages: Sequence[PipelineStage],
    schedule: str | _Unset = UNSET,
    *,
    inputs: Any,
    targets: Any = None,
    loss_fn: LossFn | None = None,
    trace: str | Path | None = None,
    options: RunOptions | None = None,
    events: RunEvents | None = None,
    **option_fields: Any,
) -> RunResult:
    """Run one training step of a pipeline schedule over ``stages``.

    ``stages`` lists every stage of the run (all ranks in this process) or, with a
    distributed transport, this process's stages. ``inputs``/``targets`` are the whole
    batch (a tensor of the stages' framework or a numpy array; ``inputs`` also a tuple of
    them, the first stage's module then called with one micro-batch of each, or a dict,
    then as keyword arguments; ``targets`` also a tuple, ``loss_fn`` then getting one),
    split along dim 0 into ``micro_batch_num`` micro-batches. A stage may pass a tuple of tensors to
    the next (``PipelineStage``). ``schedule`` (default ``"gpipe"``, or the one of
    ``options``) and the other keywords are the fields
    of :class:`~ppswap.options.RunOptions` (``micro_batch_num``, ``swap``, ``pp``,
    ``split_dw``, ``overlap_b_f``, ``p2p``, ``min_swap_gap``, ``swap_policy``,
    ``cost_model``, ``swap_check``, ``count_saved_bytes``, ``loss_scale``, ``forward_only``,
    ``step_timeout``, ``transport``,
    ``device``, ``mesh``, ``faults``), or pass ``options=RunOptions(...)`` (keywords
    override its fields). ``swap=True`` injects the swap steps; activations move only
    where the user marked them with ``swap_wrapper`` / ``swap_tensor_wrapper``.
    ``trace``: a path for a Chrome trace of the run. ``events``: a ``ppswap.events.RunEvents``
    that gets the run's progress as it happens (never slowing it).

    FSDP (docs/fsdp.md): when the stages' modules are ``fully_shard()``-ed, ``stages`` lists
    every (stage, dp replica) and the run has ``pp * dp`` ranks in this process; with a
    distributed transport of ``pp * dp`` processes, this process is world rank ``w`` and
    ``stages`` lists the stages of pipeline rank ``w % pp`` in replica ``w // pp``. The
    batch (the whole batch, in every process) is split into dp contiguous blocks, then
    each block into micro-batches.
    """
    if schedule is not UNSET:
        option_fields["schedule"] = schedule
    run_options = RunOptions.of(options, **option_fields)
    plan = prepare_run(
        stages, run_options, inputs=inputs, targets=targets, loss_fn=loss_fn, trace=trace
    )
    engine = run_options.device or plan.stages[0].default_copy_engine()
    if run_options.swap:  # one device per engine: refused here, before any work
        engine.check_devices([plan.backend.device_of(stage.module) for stage in plan.stages])
    transport = run_options.transport or InProcessTransport()
    async with _exclusive_run():
        with plan.backend.run_scope():
            return await _run(plan, transport, engine, events)


@dataclass(frozen=True, slots=True)
class _Wiring:
    """What every rank runtime of a run is wired to."""

    compute: DedicatedThread
    transport: Transport
    engine: CopyEngine
    recorder: FlightRecorder
    batches: Batches
    runs: StageRuns
    log_steps: bool
    handoff: ThreadHandoff | None
    events: RunEvents | None
    ties: TieSums | None = None

    def rank(self, rank: int, plan: RunPlan, generation: int) -> RankRuntime:
        return RankRuntime(
            rank,
            plan,
            generation=generation,
            runs=self.runs,
            compute=self.compute,
            transport=self.transport,
            engine=self.engine,
            recorder=self.recorder,
            batches=self.batches,
            log_steps=self.log_steps,
            handoff=self.handoff,
            events=self.events,
            ties=self.ties,
        )


async def _run(
    plan: RunPlan, transport: Transport, engine: CopyEngine, events: RunEvents | None
) -> RunResult:
    # The library stays silent unless the application configured structlog (structlog's
    # unconfigured default prints every event): then it logs run and per-step events.
    log_steps = structlog.is_configured()
    log = structlog.get_logger("ppswap").bind(actor="runtime")
    timeline = events is not None and events.timeline
    recorder = FlightRecorder(keep_spans=plan.trace is not None or timeline)
    generation = max(stage.generation for stage in plan.stages) + 1
    compute = DedicatedThread("ppswap-compute", join_s=_TEARDOWN_TIMEOUT_S)
    recorder.register_status("compute thread", lambda: f"running {compute.current_job}")
    recorder.register_status("transport", lambda: repr(transport.stats()))
    configure_transport(transport, plan.config.num_stages, plan.config.micro)
    training = not plan.config.forward_only
    args = (transport, plan.config, plan.mesh, plan.step_timeout)
    tie_groups = await resolve_ties(plan.ties, *args) if training else ()
    plan = with_tie_steps(plan, tie_groups)  # each holder rank's TIED_GRAD_SUM, last
    if log_steps:
        log.info("run_start", generation=generation, ranks=list(plan.local_ranks))
    if events is not None:
        events.emit(_started(plan, generation))
    started = time.perf_counter()
    try:
        async with compute:
            batches, runs = await compute.run(_begin_stages, plan)
            # Ranks that share this process's compute thread and one event loop hand their
            # payloads over on the thread as well (``ThreadHandoff``), unless a fault plan
            # wraps the transport: then every message takes the path its rules wrap.
            shared = is_immediate(transport) and len(plan.local_ranks) > 1
            wrapped = plan.faults is not None and plan.faults.covers(FaultSite.P2P)
            handoff = ThreadHandoff() if shared and not wrapped else None
            ties = None
            if tie_groups:
                layout = (plan.backend, plan.config, plan.mesh, runs)
                ties = TieSums(
                    plan.ties, tie_groups, *layout, distributed=is_distributed(transport)
                )
            wiring = _Wiring(
                compute,
                transport,
                engine,
                recorder,
                batches,
                runs,
                log_steps,
                handoff,
                events,
                ties,
            )
            ranks = [wiring.rank(rank, plan, generation) for rank in plan.local_ranks]
            try:
                await _run_ranks(compute, ranks)
                stats = await compute.run(_closed_stats, plan, ranks, runs)
            except BaseException as exc:
                error = first_pipeline_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
                if isinstance(error, Exception):  # a failure, not a cancellation
                    abort_job(transport, error)
                await _teardown(compute, plan, ranks, transport)
                if error is exc:
                    raise
                # Keep the failure's own cause (the PipelineError contract), not the group.
                raise error from error.__cause__
    except BaseException as exc:
        # From RunStarted on, every way out but success tells the stream how the run
        # ended (a cancellation while the stages begin too, not only in the ranks).
        if events is not None:
            error = first_pipeline_error(exc) if isinstance(exc, BaseExceptionGroup) else exc
            events.emit(_ended(generation, error))
        raise
    elapsed = time.perf_counter() - started
    for run in runs.values():  # the stages' results; a failed run never gets here
        run.publish(generation)
    losses = _collect_losses(plan, ranks)
    outputs = _collect_outputs(plan, ranks) if plan.returns_outputs else []
    warn_if_nothing_swapped(plan.config, plan.orders, {s.rank: s.offloaded_bytes for s in stats})
    if is_distributed(transport):
        losses, stats = await gather_results(transport, stats[0], losses, plan.config.micro)
    result = RunResult(
        losses=losses,
        loss=float(sum(losses) / len(losses)) if losses else math.nan,
        ranks=stats,
        generation=generation,
        step_time_s=elapsed,
        trace_path=None if plan.trace is None else recorder.write_chrome_trace(plan.trace),
        swap=plan.config.swap,
        schedule=plan.config.schedule,
        outputs=outputs,
    )
    if log_steps:
        log.info("run_end", generation=generation, loss=result.loss, step_time_s=elapsed)
    if events is not None:
        spans = sorted(recorder.spans, key=lambda s: s.start_us) if timeline else []
        lanes = tuple(
            TimelineSpan(s.rank, s.actor, s.name, s.start_us * 1e-6, s.duration_us * 1e-6)
            for s in spans
        )
        events.emit(RunFinished(generation=generation, result=result, timeline=lanes))
    return result


def _started(plan: RunPlan, generation: int) -> RunStarted:
    config = plan.config
    return RunStarted(
        generation=generation,
        ranks=tuple(plan.local_ranks),
        schedule=config.schedule,
        swap=config.swap,
        micro_batch_num=config.micro,
    )


def _ended(generation: int, error: BaseException) -> RunFailed | RunCancelled:
    """The event of a run that ``error`` ended: a failure, or a cancellation."""
    if isinstance(error, Exception):
        message = (str(error).splitlines() or [""])[0]
        return RunFailed(generation=generation, error_type=type(error).__name__, message=message)
    return RunCancelled(generation=generation)


async def _run_ranks(compute: DedicatedThread, ranks: list[RankRuntime]) -> None:
    for rank in ranks:
        if rank.fsdp is not None:
            await compute.run(rank.fsdp.begin)
    async with anyio.create_task_group() as tg:
        for rank in ranks:
            rank.start(tg)


def _begin_stages(plan: RunPlan) -> tuple[Batches, StageRuns]:
    """Compute thread, one job: the batch split into micro-batches, and every stage's
    ``StageRun`` for this run (training gradients starting from none, its random-number
    stream seeded, the scope of its forwards set)."""
    batches = split_batches(plan)
    rng_seed = plan.backend.run_seed()  # one draw per run, whatever stages run here
    runs = {
        stage: StageRun(
            stage,
            micro_count=plan.config.micro,
            loss_fn=plan.loss_fn if stage.is_last else None,
            forward_only=plan.config.forward_only,
            rng_seed=rng_seed,
            forward_scope=plan.forward_scope,
            input_keys=plan.input_keys,
            target_parts=plan.target_parts,
            loss_scale=plan.options.loss_scale,
        )
        for stage in plan.stages
    }
    return batches, runs


def _closed_stats(plan: RunPlan, ranks: list[RankRuntime], runs: StageRuns) -> list[RankStats]:
    """Compute thread, after a successful run: close every session, give a training
    run's gradients to the stages' parameters (``Backend.give_grads``, every stage of this
    process in one call: a parameter two stages share gets the sum), then each rank's
    stats (parameter bytes measured from the storages of a pp-only rank's stages)."""
    for rank in ranks:
        rank.session.close()
    if not plan.config.forward_only:
        plan.backend.give_grads(*grads_to_give(list(runs.values())))
    measure = plan.mesh is None
    return [rank.stats(param_storage_bytes(rank.stages) if measure else 0) for rank in ranks]


def _abort_all(plan: RunPlan, ranks: list[RankRuntime]) -> None:
    """Compute thread, after a failed or cancelled run: every rank torn down, then the
    framework's records of forwards whose backward never ran dropped."""
    try:
        for rank in ranks:
            rank.abort()
    finally:
        # The forwards whose backward never ran may stay recorded in the framework
        # (memory that is never given back) until this; see the backend's autograd.
        plan.backend.autograd.discard_all()


async def _teardown(
    compute: DedicatedThread, plan: RunPlan, ranks: list[RankRuntime], transport: Transport
) -> None:
    """Best-effort cleanup after a failed or cancelled run (shielded, bounded)."""
    for rank in ranks:  # no transport callback reaches this run any more
        rank.p2p_actor.cancel_started()
    with anyio.CancelScope(shield=True), anyio.move_on_after(_TEARDOWN_TIMEOUT_S):
        await compute.run(_abort_all, plan, ranks)
        for rank in ranks:
            if rank.fsdp is not None:
                await compute.run(rank.fsdp.abort)
    if isinstance(transport, InProcessTransport):
        transport.reset()


def _last_stage_replicas(plan: RunPlan, ranks: list[RankRuntime]) -> list[ComputeActor]:
    """The compute actors of this process's ranks that run the last stage, in rank order
    (one per dp replica with FSDP, replica after replica)."""
    config = plan.config
    last_rank = config.rank_of(config.num_stages - 1)
    return [r.compute_actor for r in ranks if r.rank % config.pp == last_rank]


def _collect_outputs(plan: RunPlan, ranks: list[RankRuntime]) -> list[Any]:
    """The last stage's outputs, micro-batch after micro-batch, replica after replica."""
    return [
        actor.outputs[m]
        for actor in _last_stage_replicas(plan, ranks)
        for m in sorted(actor.outputs)
    ]


def _collect_losses(plan: RunPlan, ranks: list[RankRuntime]) -> list[float]:
    """Per micro-batch, the mean over dp replicas of the last stage's loss (one replica
    without FSDP)."""
    replicas = _last_stage_replicas(plan, ranks)
    if not replicas:
        return []
    micros = sorted(replicas[0].losses)
    kept = plan.backend.host_floats([actor.losses[m] for m in micros for actor in replicas])
    count = len(replicas)
    return [sum(kept[i * count : (i + 1) * count]) / count for i in range(len(micros))]
