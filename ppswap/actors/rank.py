"""RankRuntime: everything one rank runs during one run, wired together.

A rank owns its swap session, its three actors (compute, copy stream, P2P: one bounded
channel from compute to P2P, its copy stream launched into directly by the compute
thread) and, with FSDP, its FSDP driver. ``start`` puts the actors into the run's task
group; ``close`` (normal end) and ``abort`` (failure or cancellation, compute thread)
tear the swap side down; ``stats`` gathers what the rank measured.
"""

from __future__ import annotations

from functools import partial

from anyio.abc import TaskGroup

from ppswap.actors.batch import StepBodies
from ppswap.actors.chunk_meter import ChunkMeter
from ppswap.actors.compute import BatchMode, ComputeActor, RankInputs
from ppswap.actors.context import RunContext
from ppswap.actors.copy_stream import CopyStream, CopyStreamActor
from ppswap.actors.handoff import ThreadHandoff
from ppswap.actors.local_steps import ARRIVAL_WAITS_PER_BATCH
from ppswap.actors.p2p import P2PActor, p2p_channel
from ppswap.actors.tie_sum import TieSums
from ppswap.actors.trace import FlightRecorder
from ppswap.backends.base import CopyEngine
from ppswap.core.executor import DedicatedThread
from ppswap.core.transport import Transport, is_immediate
from ppswap.events import RunEvents
from ppswap.fsdp.driver import FsdpRankDriver
from ppswap.fsdp.plan import collectives_for
from ppswap.moe.runner import ExpertRunner
from ppswap.planning.data import Batches
from ppswap.planning.prepare import RunPlan
from ppswap.results import RankStats
from ppswap.scheduler.recompute_plan import chunk_policies
from ppswap.scheduler.steps import RECOMPUTE
from ppswap.scheduler.swap_plan import eligible_chunks
from ppswap.stage import PipelineStage
from ppswap.stage_run import StageRuns
from ppswap.swap import PipelineSwapSession, SwapManager

__all__ = ["RankRuntime"]


class RankRuntime:
    """One rank of one run (see the module docstring)."""

    def __init__(
        self,
        rank: int,
        plan: RunPlan,
        *,
        generation: int,
        runs: StageRuns,
        compute: DedicatedThread,
        transport: Transport,
        engine: CopyEngine,
        recorder: FlightRecorder,
        batches: Batches,
        log_steps: bool,
        handoff: ThreadHandoff | None = None,
        events: RunEvents | None = None,
        ties: TieSums | None = None,
    ) -> None:
        self.rank = rank
        self.stages: tuple[PipelineStage, ...] = plan.stages_of(rank)
        order = plan.orders[rank]
        config = plan.config
        run = RunContext(
            rank=rank,
            generation=generation,
            step_timeout_s=plan.step_timeout,
            recorder=recorder,
            faults=plan.faults,
            log_steps=log_steps,
            events=events,
        )
        self.context = run
        eligible = eligible_chunks(order)
        self._copies_planned = bool(eligible)
        self.session = PipelineSwapSession(
            SwapManager(plan.backend),
            engine,
            rank=rank,
            generation=generation,
            eligible=eligible,
            wait_timeout_s=run.step_timeout_s,
            check=plan.swap_check,
            count_saved=plan.count_saved_bytes or bool(eligible),  # swap counts what it holds
            min_bytes=plan.swap_min_bytes,
            recomputed=frozenset(s.chunk for s in order if s.kind is RECOMPUTE),
        )
        self._chunk_policy = chunk_policies(order)
        self.meter = ChunkMeter(self.session)  # what each chunk keeps: RankStats.chunk_bytes
        self._budget = None if plan.budget is None else plan.budget.ranks[rank % config.pp]
        self._predicted_step_s = 0.0 if plan.budget is None else plan.budget.step_s
        p2p_tx, p2p_rx = p2p_channel(plan.channel_capacity)
        recorder.register_channel(rank, "compute->p2p", p2p_tx)
        self.copy_stream = CopyStream(
            rank, recorder, faults=plan.faults, generation=generation, log_steps=log_steps
        )
        recorder.register_pending(rank, CopyStreamActor.actor_name, self.copy_stream.pending)
        by_index = {s.stage_index: s for s in self.stages}
        # What the run changes of each stage: its StageRun, dropped with the rank.
        self.runs = {s.stage_index: runs[s] for s in self.stages}
        self.fsdp: FsdpRankDriver | None = None
        if plan.mesh is not None:
            self.fsdp = FsdpRankDriver(
                rank=rank,
                mesh=plan.mesh,
                order=order,
                stages=self.runs,
                compute=compute,
                p2p=p2p_tx,
                timeout_s=run.step_timeout_s,
                reduce_grads=not config.forward_only,
            )
        # A batch waits for the receives, copies and all-gathers its jobs need on the
        # compute thread: blocking when the rank is alone in its process (nobody else
        # needs the thread; ARRIVAL_WAITS_PER_BATCH bounds the receives it runs ahead
        # of), parked when the ranks of this process share the thread (nothing is held
        # while parked, so the budget is the whole order).
        if len(plan.local_ranks) > 1:
            mode = BatchMode(arrival_waits=len(order), parks=True, handoff=handoff)
        else:
            mode = BatchMode(arrival_waits=ARRIVAL_WAITS_PER_BATCH)
        self.experts: ExpertRunner | None = None
        # A MoE block's load-balancing term is seeded like the loss (StageRun).
        aux_grad_scale = 0.0 if config.forward_only else plan.options.loss_scale / config.micro
        if ExpertRunner.needed(plan.mesh, self.stages):
            self.experts = ExpertRunner(
                rank=rank,
                mesh=plan.mesh,
                stages=by_index,
                sink=p2p_tx,
                shared=mode.parks,
                aux_grad_scale=aux_grad_scale,
                timeout_s=run.step_timeout_s,
                dump=recorder.dump,
            )
        record = not config.forward_only
        bodies = StepBodies(
            self.meter,
            self.copy_stream,
            host_payloads=not is_immediate(transport),
            record=record,
            # A forward-only output is not kept by the stage, so it is always copied.
            zero_copy_sends=config.p2p == "boundary" and record,
        )
        replica = batches.of_replica(plan.dp_index(rank), config.micro)
        self.compute_actor = ComputeActor(
            run,
            order=order,
            stages=self.runs,
            data=RankInputs(replica.inputs, replica.targets, outputs=plan.returns_outputs),
            bodies=bodies,
            compute=compute,
            p2p=p2p_tx,
            fsdp=self.fsdp,
            mode=mode,
            experts=self.experts,
            ties=None if ties is None else ties.driver(rank, p2p_tx),
        )
        self.copy_actor = CopyStreamActor(self.copy_stream, timeout_s=plan.step_timeout)
        self.p2p_actor = P2PActor(
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
        p2p_tx.actor = self.p2p_actor  # sends and receives go to it as they are posted

    def start(self, tg: TaskGroup) -> None:
        """Start the copy stream (with a thread if the rank's order copies anything) and
        the three actors in ``tg``."""
        self.copy_stream.start(thread=self._copies_planned)
        tg.start_soon(self.compute_actor.run, name=f"compute-{self.rank}")
        tg.start_soon(self.copy_actor.run, name=f"copy-{self.rank}")
        tg.start_soon(self.p2p_actor.run, name=f"p2p-{self.rank}")

    # -- compute thread -------------------------------------------------------------------
    def abort(self) -> None:
        """After a failed or cancelled run: release the stages' abandoned records (before
        the groups go: their release unpacks from them), then abort the session."""
        for run in self.runs.values():
            run.abort(partial(_copies_settled, self.session))
        self.session.abort()

    def stats(self, param_bytes: int) -> RankStats:
        """What the rank measured; ``param_bytes``: the measured parameter bytes of a
        pp-only rank (FSDP ranks report their driver's)."""
        swap = self.session.stats()
        compute = self.compute_actor.stats()
        copy = self.copy_actor.stats()
        peak_params = resident_params = unsharded_params = param_bytes
        if self.fsdp is not None:
            fsdp = self.fsdp.stats()
            peak_params = fsdp.peak_param_bytes
            resident_params = fsdp.resident_param_bytes
            unsharded_params = fsdp.unsharded_param_bytes
        return RankStats(
            rank=self.rank,
            peak_saved_bytes=swap.peak_saved_bytes,
            offloaded_bytes=swap.offloaded_bytes,
            loaded_bytes=swap.loaded_bytes,
            exposed_copy_wait_s=compute.exposed_copy_wait_s,
            steps_executed=compute.steps_executed,
            copies=copy.copies,
            copy_busy_s=copy.busy_s,
            groups_left=swap.live_groups,
            saved_bytes_left=swap.resident_saved_bytes,
            peak_param_bytes=peak_params,
            resident_param_bytes=resident_params,
            unsharded_param_bytes=unsharded_params,
            compute_job_s=compute.job_s,
            compute_jobs=compute.jobs,
            compute_batches=compute.batches,
            chunk_policy=self._chunk_policy,
            chunk_bytes=self.meter.chunk_bytes,
            predicted_peak_saved_bytes=0 if self._budget is None else self._budget.peak_bytes,
            predicted_step_s=self._predicted_step_s,
            aux_loss=0.0 if self.experts is None else self.experts.aux_loss(),
        )


def _copies_settled(session: PipelineSwapSession, stage: int, micro: int) -> bool:
    """Whether every copy job of chunk (stage, micro) has ended (or it has no group): then
    its backward can unpack without waiting for a copy that no actor will run any more."""
    name = session.group_name(stage, micro)
    if name not in session.manager:
        return True
    return all(job.done.is_set() for job in session.manager.get_group(name).jobs())
