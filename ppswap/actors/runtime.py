"""``run_schedule``: plan, wire and run the actors of every local rank; collect the result.

One run, start to end:

1. Check every argument (``ppswap.actors.inputs``) and build the finalized, validated
   per-rank orders. Nothing has run yet when a bad input is refused.
2. Start the process's single compute thread, then one task group holding, per local rank,
   a compute actor, a copy-stream actor (with its own copy thread) and a P2P actor, wired by
   bounded memory channels. The compute actor owns the sending sides: when its order is
   done it closes them, the other two actors drain and exit, the task group joins.
3. On success every swap session is closed (every group gone). On failure or cancellation
   the task group cancels every actor, the copy actor finishes the copy in flight, and the
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
``faults`` (a ``FaultPlan``, tests only) injects failures and delays into the actors.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import structlog

from ppswap.actors.compute import ComputeActor, RankInputs
from ppswap.actors.copy_stream import CopyStreamActor
from ppswap.actors.distributed import (
    abort_job,
    configure_transport,
    gather_results,
    is_distributed,
)
from ppswap.actors.executor import DedicatedThread
from ppswap.actors.faults import FaultPlan
from ppswap.actors.inputs import RunPlan, prepare_run, split_batches
from ppswap.actors.messages import CopyRequest, P2PRequest
from ppswap.actors.p2p import InProcessTransport, P2PActor, Transport
from ppswap.actors.trace import FlightRecorder
from ppswap.backends.base import CopyEngine
from ppswap.errors import first_pipeline_error
from ppswap.fsdp.driver import FsdpRankDriver
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.fsdp.plan import collectives_for, param_storage_bytes
from ppswap.scheduler.cost import CostModel, SwapPolicy
from ppswap.scheduler.swap_plan import eligible_chunks
from ppswap.stage import LossFn, PipelineStage
from ppswap.swap import PipelineSwapSession, SwapManager

__all__ = ["RankStats", "RunResult", "run_schedule"]

# The deadline of every single wait (a receive, a copy, a collective, a compute job), not
# of the run. The longest legitimate wait is a receive on the last rank during the
# pipeline fill (about 2 * pp compute slots) or a first step that compiles kernels; five
# minutes is far above that for the models this runtime serves, and short enough that a
# service learns of a hang in minutes (torch.distributed's NCCL default is ten). Raise it
# for very slow steps; math.inf turns the watchdog off.
DEFAULT_STEP_TIMEOUT_S = 300.0
_TEARDOWN_TIMEOUT_S = 60.0

# One run at a time per process: MindSpore autograd must see a single compute thread.
_RUN_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class RankStats:
    """What one rank measured during a run."""

    rank: int
    peak_saved_bytes: int
    offloaded_bytes: int
    loaded_bytes: int
    exposed_copy_wait_s: float
    steps_executed: int
    copies: int
    copy_busy_s: float
    groups_left: int = 0  # swap groups alive after the run closed: 0 unless a bug
    saved_bytes_left: int = 0  # saved bytes still counted after the run: back to 0
    # Parameter bytes of the rank's stages, measured from their storages: at the peak and
    # at the end of the run (between uses: the shards under FSDP), and unsharded.
    peak_param_bytes: int = 0
    resident_param_bytes: int = 0
    unsharded_param_bytes: int = 0
    # Seconds and count of the rank's compute-thread jobs by kind ("forward", "backward",
    # "backward_input", "backward_weight", "swap_prepare", "swap_finish"), timed on the
    # thread: what a CostModel's leaf_s, backward_leaf_s and swap_step_s are measured from.
    compute_job_s: Mapping[str, float] = field(default_factory=dict)
    compute_jobs: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RunResult:
    """The outcome of one run.

    ``losses`` has one float per micro-batch (the last stage's), ``loss`` their mean,
    ``ranks`` is indexed by rank, ``trace_path`` is where the Chrome trace went (if asked).
    With FSDP (a DP x PP mesh) ``losses[m]`` is the mean over dp replicas of their
    micro-batch ``m`` (equal-sized, so the mean loss of the global micro-batch) and
    ``ranks`` is indexed by world rank (``dp_index * pp + pp_index``).
    """

    losses: list[float]
    loss: float
    ranks: list[RankStats]
    generation: int
    step_time_s: float
    trace_path: Path | None = None
    swap: bool = False
    schedule: str = ""
    extras: dict[str, Any] = field(default_factory=dict)


@asynccontextmanager
async def _exclusive_run() -> AsyncIterator[None]:
    if not _RUN_LOCK.acquire(blocking=False):
        raise RuntimeError(
            "another ppswap run is active in this process; runs share the single "
            "MindSpore compute thread, so run them one after another"
        )
    try:
        yield
    finally:
        _RUN_LOCK.release()


async def run_schedule(
    stages: Sequence[PipelineStage],
    schedule: str = "gpipe",
    *,
    micro_batch_num: int,
    inputs: Any,
    targets: Any = None,
    loss_fn: LossFn | None = None,
    swap: bool = False,
    pp: int | None = None,
    split_dw: bool = False,
    overlap_b_f: bool = False,
    p2p: str = "plain",
    min_swap_gap: int = 4,
    forward_only: bool = False,
    trace: str | Path | None = None,
    step_timeout: float = DEFAULT_STEP_TIMEOUT_S,
    transport: Transport | None = None,
    device: CopyEngine | None = None,
    mesh: DeviceMesh | None = None,
    faults: FaultPlan | None = None,
    swap_policy: SwapPolicy = "gap",
    cost_model: CostModel | None = None,
) -> RunResult:
    """Run one training step of a pipeline schedule over ``stages``; see DESIGN.md §6.

    ``stages`` lists every stage of the run (all ranks in this process) or, with an MPI
    transport, this process's stages. ``inputs``/``targets`` are the whole batch (a
    MindSpore Tensor or a numpy array), split along dim 0 into ``micro_batch_num``
    micro-batches. ``swap=True`` injects the swap steps; activations move only where the
    user marked them with ``swap_wrapper`` / ``swap_tensor_wrapper``.

    FSDP (docs/fsdp.md): when the stages' modules are ``fully_shard()``-ed, ``stages`` lists
    every (stage, dp replica) and the run has ``pp * dp`` ranks in this process; the mesh
    is read from the stages (``mesh``, if given, must be the same). The batch is split
    into dp contiguous blocks, then each block into micro-batches.

    ``forward_only=True`` runs the forwards only (no graph recorded, gradients untouched)
    and returns the losses. ``step_timeout`` bounds every single wait (see
    ``DEFAULT_STEP_TIMEOUT_S``). ``faults`` injects test faults (``ppswap.actors.faults``).

    ``swap_policy="cost"`` with ``cost_model=CostModel(...)`` swaps, per rank, the chunks
    that keep the predicted exposed copy wait within the model's budget at the lowest
    peak (``ppswap.scheduler.cost``); the default ``"gap"`` is the fixed rule
    ``gap >= min_swap_gap``. Either way only with ``swap=True``.
    """
    if device is not None and not isinstance(device, CopyEngine):
        raise TypeError(f"device must implement CopyEngine or be None, got {type(device).__name__}")
    plan = prepare_run(
        stages,
        schedule,
        micro_batch_num=micro_batch_num,
        inputs=inputs,
        targets=targets,
        loss_fn=loss_fn,
        swap=swap,
        pp=pp,
        split_dw=split_dw,
        overlap_b_f=overlap_b_f,
        p2p=p2p,
        min_swap_gap=min_swap_gap,
        forward_only=forward_only,
        step_timeout=step_timeout,
        transport=transport,
        trace=trace,
        mesh=mesh,
        faults=faults,
        swap_policy=swap_policy,
        cost_model=cost_model,
    )
    engine = device if device is not None else plan.backend.copy_engine()
    async with _exclusive_run():
        with plan.backend.run_scope():
            return await _run(plan, transport or InProcessTransport(), engine)


async def _run(plan: RunPlan, transport: Transport, engine: CopyEngine) -> RunResult:
    log = structlog.get_logger("ppswap").bind(actor="runtime")
    # The library stays silent unless the application configured structlog (structlog's
    # unconfigured default prints every event): then it logs run and per-step events.
    log_steps = structlog.is_configured()
    recorder = FlightRecorder(keep_spans=plan.trace is not None)
    generation = max(stage.generation for stage in plan.stages) + 1
    config = plan.config
    sessions: dict[int, PipelineSwapSession] = {}
    actors: dict[int, ComputeActor] = {}
    copy_actors: dict[int, CopyStreamActor] = {}
    drivers: dict[int, FsdpRankDriver] = {}
    param_bytes: dict[int, int] = {}
    started = time.perf_counter()
    if log_steps:
        log.info(
            "run_start",
            schedule=config.schedule,
            pp=config.pp,
            vpp=config.vpp,
            micro=config.micro,
            swap=config.swap,
            generation=generation,
            ranks=list(plan.local_ranks),
        )
    compute = DedicatedThread("ppswap-compute", join_s=_TEARDOWN_TIMEOUT_S)
    recorder.register_status("compute thread", lambda: f"running {compute.current_job}")
    recorder.register_status("transport", lambda: repr(transport.stats()))
    configure_transport(transport, config.num_stages, config.micro)
    async with compute:
        batches = await compute.run(split_batches, plan)
        for stage in plan.stages:
            await compute.run(_begin_stage, stage, plan, generation)
        for rank in plan.local_ranks:
            order = plan.orders[rank]
            sessions[rank] = PipelineSwapSession(
                SwapManager(plan.backend),
                engine,
                rank=rank,
                generation=generation,
                eligible=eligible_chunks(order),
                wait_timeout_s=plan.step_timeout,
            )
        succeeded = False
        try:
            async with anyio.create_task_group() as tg:
                for rank in plan.local_ranks:
                    p2p_tx, p2p_rx = anyio.create_memory_object_stream[P2PRequest](
                        plan.channel_capacity
                    )
                    copy_tx, copy_rx = anyio.create_memory_object_stream[CopyRequest](
                        plan.channel_capacity
                    )
                    recorder.register_channel(rank, "compute->p2p", p2p_tx)
                    recorder.register_channel(rank, "compute->copy", copy_tx)
                    if plan.mesh is not None:
                        drivers[rank] = FsdpRankDriver(
                            rank=rank,
                            mesh=plan.mesh,
                            order=plan.orders[rank],
                            stages={s.stage_index: s for s in plan.stages_of(rank)},
                            compute=compute,
                            p2p=p2p_tx,
                            timeout_s=plan.step_timeout,
                            reduce_grads=not config.forward_only,
                        )
                        await compute.run(drivers[rank].begin)
                    replica = batches.of_replica(plan.dp_index(rank), config.micro)
                    actors[rank] = ComputeActor(
                        rank=rank,
                        order=plan.orders[rank],
                        config=config,
                        stages={s.stage_index: s for s in plan.stages_of(rank)},
                        compute=compute,
                        session=sessions[rank],
                        p2p=p2p_tx,
                        copy=copy_tx,
                        recorder=recorder,
                        data=RankInputs(replica.inputs, replica.targets),
                        generation=generation,
                        timeout_s=plan.step_timeout,
                        log_steps=log_steps,
                        fsdp=drivers.get(rank),
                        faults=plan.faults,
                    )
                    copy_actors[rank] = CopyStreamActor(
                        rank,
                        _copy_thread(rank),
                        copy_rx,
                        recorder,
                        generation=generation,
                        log_steps=log_steps,
                        timeout_s=plan.step_timeout,
                        faults=plan.faults,
                    )
                    p2p_actor = P2PActor(
                        rank,
                        transport,
                        p2p_rx,
                        recorder,
                        timeout_s=plan.step_timeout,
                        generation=generation,
                        log_steps=log_steps,
                        collectives=collectives_for(transport),
                        faults=plan.faults,
                    )
                    tg.start_soon(actors[rank].run, name=f"compute-{rank}")
                    tg.start_soon(_run_copy_actor, copy_actors[rank], name=f"copy-{rank}")
                    tg.start_soon(p2p_actor.run, name=f"p2p-{rank}")
            for session in sessions.values():
                await compute.run(session.close)
            if plan.mesh is None:
                for rank in plan.local_ranks:
                    param_bytes[rank] = await compute.run(param_storage_bytes, plan.stages_of(rank))
            succeeded = True
        except BaseExceptionGroup as group:
            error = first_pipeline_error(group)
            abort_job(transport, error)
            if error is group:
                raise
            # Keep the failure's own cause (the PipelineError contract), not the group.
            raise error from error.__cause__
        finally:
            if not succeeded:
                await _teardown(compute, plan, sessions, transport)
                await _abort_fsdp(compute, drivers)
    elapsed = time.perf_counter() - started
    for stage in plan.stages:
        stage.generation = generation
    losses = _collect_losses(plan, actors)
    ranks = [
        _with_param_stats(
            _rank_stats(rank, sessions[rank], actors[rank], copy_actors[rank]),
            drivers.get(rank),
            param_bytes.get(rank, 0),
        )
        for rank in plan.local_ranks
    ]
    if is_distributed(transport):
        losses, ranks = await gather_results(transport, ranks[0], losses, config.micro)  # type: ignore[arg-type]
    trace_path = recorder.write_chrome_trace(plan.trace) if plan.trace is not None else None
    result = RunResult(
        losses=losses,
        loss=float(sum(losses) / len(losses)) if losses else math.nan,
        ranks=ranks,
        generation=generation,
        step_time_s=elapsed,
        trace_path=trace_path,
        swap=config.swap,
        schedule=config.schedule,
    )
    if log_steps:
        log.info("run_end", generation=generation, loss=result.loss, step_time_s=elapsed)
    return result


def _copy_thread(rank: int) -> DedicatedThread:
    return DedicatedThread(f"ppswap-copy-{rank}", join_s=_TEARDOWN_TIMEOUT_S)


async def _run_copy_actor(actor: CopyStreamActor) -> None:
    async with actor.thread:
        await actor.run()


def _begin_stage(stage: PipelineStage, plan: RunPlan, generation: int) -> None:
    stage.begin_run(
        micro_count=plan.config.micro,
        loss_fn=plan.loss_fn if stage.is_last else None,
        generation=generation,
        forward_only=plan.config.forward_only,
    )


def _copies_settled(session: PipelineSwapSession, stage: int, micro: int) -> bool:
    """Whether every copy job of chunk (stage, micro) has ended (or it has no group): then
    its backward can unpack without waiting for a copy that no actor will run any more."""
    name = session.group_name(stage, micro)
    if name not in session.manager:
        return True
    return all(job.done.is_set() for job in session.manager.get_group(name).jobs())


def _abort_all(plan: RunPlan, sessions: dict[int, PipelineSwapSession]) -> None:
    """Teardown on the compute thread: release the stages' abandoned records (before the
    groups go: their backward unpacks from them), abort the sessions, then discard_all."""
    for rank in plan.local_ranks:
        session = sessions.get(rank)
        for stage in plan.stages_of(rank):
            if session is None:
                stage.abort_run()
            else:
                stage.abort_run(partial(_copies_settled, session))
    try:
        for session in sessions.values():
            session.abort()
    finally:
        # The forwards whose backward never ran may stay recorded in the framework
        # (memory that is never given back) until this; see the backend's autograd.
        plan.backend.autograd.discard_all()


async def _teardown(
    compute: DedicatedThread,
    plan: RunPlan,
    sessions: dict[int, PipelineSwapSession],
    transport: Transport,
) -> None:
    """Best-effort cleanup after a failed or cancelled run (shielded, bounded)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(_TEARDOWN_TIMEOUT_S):
        await compute.run(_abort_all, plan, sessions)
    if isinstance(transport, InProcessTransport):
        transport.reset()


def _collect_losses(plan: RunPlan, actors: dict[int, ComputeActor]) -> list[float]:
    """Per micro-batch, the mean over dp replicas of the last stage's loss (one replica
    without FSDP)."""
    config = plan.config
    last_rank = config.rank_of(config.num_stages - 1)
    replicas = [actors[r] for r in plan.local_ranks if r % config.pp == last_rank]
    if not replicas:
        return []
    micros = sorted(replicas[0].losses)
    return [sum(actor.losses[m] for actor in replicas) / len(replicas) for m in micros]


def _with_param_stats(stats: RankStats, driver: FsdpRankDriver | None, measured: int) -> RankStats:
    """Fill the parameter-memory fields: the FSDP driver's measurements, or the measured
    (unsharded) parameter bytes of a pp-only rank."""
    if driver is None:
        return replace(
            stats,
            peak_param_bytes=measured,
            resident_param_bytes=measured,
            unsharded_param_bytes=measured,
        )
    fsdp = driver.stats()
    return replace(
        stats,
        peak_param_bytes=fsdp.peak_param_bytes,
        resident_param_bytes=fsdp.resident_param_bytes,
        unsharded_param_bytes=fsdp.unsharded_param_bytes,
    )


async def _abort_fsdp(compute: DedicatedThread, drivers: dict[int, FsdpRankDriver]) -> None:
    """After a failed run: every sharded stage back to its shards (shielded, bounded)."""
    with anyio.CancelScope(shield=True), anyio.move_on_after(_TEARDOWN_TIMEOUT_S):
        for driver in drivers.values():
            await compute.run(driver.abort)


def _rank_stats(
    rank: int, session: PipelineSwapSession, actor: ComputeActor, copy: CopyStreamActor
) -> RankStats:
    swap_stats = session.stats()
    compute_stats = actor.stats()
    copy_stats = copy.stats()
    return RankStats(
        rank=rank,
        peak_saved_bytes=swap_stats.peak_saved_bytes,
        offloaded_bytes=swap_stats.offloaded_bytes,
        loaded_bytes=swap_stats.loaded_bytes,
        exposed_copy_wait_s=compute_stats.exposed_copy_wait_s,
        steps_executed=compute_stats.steps_executed,
        copies=copy_stats.copies,
        copy_busy_s=copy_stats.busy_s,
        groups_left=swap_stats.live_groups,
        saved_bytes_left=swap_stats.resident_saved_bytes,
        compute_job_s=compute_stats.job_s,
        compute_jobs=compute_stats.jobs,
    )
