"""FsdpRankDriver: one rank's FSDP_UNSHARD / FSDP_RESHARD work, as jobs of its compute batches.

The compute actor builds its batches on the event loop (``ppswap.actors.local_steps``) and
asks the driver, as it goes, for the compute-thread job of every FSDP step (``job``) and,
before each compute leaf, for the job that installs that stage's gathered parameters
(``install_before``; None when they are installed already). So FSDP runs on the same
batched path as everything else: a collective costs no hop of its own. Collectives go to
the rank's P2P actor as ``CollectiveRequest`` messages, posted from the compute thread
through the event loop (``loop_caller``: FIFO, never blocking the thread); the P2P lane of
the trace shows them as ``all_gather unshard.s{stage}`` and ``reduce_scatter_sum
grads.s{stage}.{dtype}``.

- FSDP_UNSHARD(s): the job snapshots the local shards (one flat byte array per stage) and
  *issues* the all-gather; it does not wait for it. The plan's one-step lookahead lets the
  all-gather run under the preceding compute.
- before a compute leaf of stage s, if an all-gather of s is in flight: a job that waits
  for its reply on the compute thread (its ``Arrival``, with the step deadline, like a
  received activation) and installs the full parameters. (Probe, mindspore 2.10 CPU: a
  recorded forward reads the *current* data of its Parameters at backward time, so FWD may
  run on one gathered copy and BWD on a later, re-gathered one; gradients are
  bit-identical to never resharding.)
- FSDP_RESHARD(s): the job installs the kept shards (the full storage is released); after
  the stage's *last* RESHARD of the order (its last backward is done) it splits the
  gradients into per-member rows and issues a reduce-scatter (sum) per dtype; the kept
  (expert) parameters' gradients go whole, in an all-gather per parameter over the ranks
  holding the same experts (``DeviceMesh.expert_replica_group``) where there are several,
  summed in group order. ``finish``
  (event loop, after the order) awaits them and sets the run's gradients to the shard
  gradients divided by ``dp`` (each replica seeds its backward with ``1 / micro``, so this
  is the gradient of the mean loss over the global batch), in one compute-thread job.
- Parameter memory is measured from the real storages after every install and reshard.

Which stage is unsharded when is tracked as the batches are built (``job``,
``install_before``): an order that uses a sharded stage, unshards twice, or ends
unsharded is refused there, before the step's batch runs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import anyio
import numpy.typing as npt

from ppswap.core.arrival import Arrival
from ppswap.core.executor import DedicatedThread, loop_caller
from ppswap.core.messages import (
    CollectiveOp,
    CollectiveRequest,
    FutureTimeoutError,
    ReplyFuture,
    RequestSink,
)
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.fsdp.shard import FsdpState, GradBucket, fsdp_state_of
from ppswap.scheduler.steps import MetaStep, Order, StepKind
from ppswap.stage_run import StageRun

__all__ = ["FsdpJob", "FsdpRankDriver", "FsdpStats"]

T = TypeVar("T")
Gathered = tuple[npt.NDArray[Any], ...]


@dataclass(frozen=True, slots=True)
class FsdpJob:
    """A compute-thread job of the FSDP driver: ``run()``, after ``arrival`` (a gathered
    reply's ``Arrival``, which ``run`` reads) where there is one. ``step``: the FSDP step
    (for an install, the FSDP_UNSHARD that issued the all-gather)."""

    step: MetaStep
    run: Callable[[], Any]
    arrival: Arrival | None = None


@dataclass(frozen=True, slots=True)
class FsdpStats:
    """Measured parameter bytes of one rank (every stage it holds), and collective counts.

    ``resident_param_bytes`` is measured at the end of the run (between uses: the shards),
    ``peak_param_bytes`` is the largest value seen after any install or reshard,
    ``unsharded_param_bytes`` what the same parameters take unsharded (from their shapes).
    """

    peak_param_bytes: int
    resident_param_bytes: int
    unsharded_param_bytes: int
    all_gathers: int
    reduce_scatters: int


@dataclass(slots=True)
class _GradSync:
    """A stage's gradient reduce-scatters: filled by its last RESHARD's job (compute
    thread), read by ``finish`` once every batch ran."""

    stage: int
    buckets: list[GradBucket] = field(default_factory=list)
    replies: list[ReplyFuture[Gathered]] = field(default_factory=list)
    kept: dict[int, npt.NDArray[Any]] = field(default_factory=dict)
    kept_replies: dict[int, ReplyFuture[Gathered]] = field(default_factory=dict)


class FsdpRankDriver:
    """Runs the FSDP steps of world rank ``rank`` over its fully_shard()-ed ``stages``
    (module docstring). ``job`` and ``install_before`` run on the event loop while a
    batch is built; the jobs they return run on the compute thread."""

    def __init__(
        self,
        *,
        rank: int,
        mesh: DeviceMesh,
        order: Order,
        stages: Mapping[int, StageRun],
        compute: DedicatedThread,
        p2p: RequestSink,
        timeout_s: float = math.inf,
        reduce_grads: bool = True,
    ) -> None:
        self.rank = rank
        self._group = mesh.dp_group(rank)
        self._expert_group = mesh.expert_replica_group(rank)
        self._stages = dict(stages)
        self._states: dict[int, FsdpState] = {}
        for index, stage in self._stages.items():
            state = fsdp_state_of(stage.module)
            if state is None or state.mesh != mesh:
                raise ValueError(
                    f"stage {index} of rank {rank} must be fully_shard()-ed with mesh={mesh!r}, "
                    f"got {state!r}"
                )
            self._states[index] = state
        self._compute = compute
        self._p2p = p2p
        self._timeout_s = timeout_s
        self._reduce_grads = reduce_grads
        self._last_reshard = Counter(s.stage for s in order if s.kind is StepKind.FSDP_RESHARD)
        self._reshards_done: Counter[int] = Counter()
        # As the batches are built: all-gathers issued and not installed yet, and the
        # stages whose full parameters are installed by then.
        self._gathers: dict[int, tuple[MetaStep, ReplyFuture[Gathered]]] = {}
        self._full: set[int] = set()
        self._grad_syncs: list[_GradSync] = []
        self._post: Callable[..., None] | None = None  # loop_caller(), made on the loop
        self._peak = 0
        self._resident = 0
        self._all_gathers = 0
        self._reduce_scatters = 0

    def stats(self) -> FsdpStats:
        return FsdpStats(
            peak_param_bytes=self._peak,
            resident_param_bytes=self._resident,
            unsharded_param_bytes=sum(state.full_nbytes for state in self._states.values()),
            all_gathers=self._all_gathers,
            reduce_scatters=self._reduce_scatters,
        )

    # -- before and after the run (compute thread) -----------------------------------------
    def begin(self) -> None:
        """Compute thread, before the run: every stage sharded (a failed run may have left
        one unsharded), and the first measurement."""
        for state in self._states.values():
            state.reshard()
        self._note(self._measure())

    def abort(self) -> None:
        """Compute thread, after a failed or cancelled run: reshard every stage."""
        for state in self._states.values():
            state.reshard()

    # -- building batches (event loop) ------------------------------------------------------
    def job(self, step: MetaStep) -> FsdpJob:
        """The compute-thread job of FSDP_UNSHARD / FSDP_RESHARD ``step`` (module
        docstring). Raises ValueError / RuntimeError for a step the order cannot run."""
        stage = self._stage(step)
        if step.kind is StepKind.FSDP_UNSHARD:
            if stage in self._full or stage in self._gathers:
                raise RuntimeError(
                    f"{step.short()}: stage {stage} is already unsharded (an UNSHARD "
                    "without a RESHARD before it)"
                )
            label = f"all_gather unshard.s{stage}"
            reply: ReplyFuture[Gathered] = ReplyFuture(label, Arrival(label))
            self._gathers[stage] = (step, reply)
            self._all_gathers += 1
            return FsdpJob(step, partial(self._unshard, step, reply))
        if step.kind is not StepKind.FSDP_RESHARD:
            raise ValueError(f"FSDP driver got a {step.kind.value} step")
        # An all-gather nobody consumed (a run without compute) is dropped: the kept
        # shard is the state to return to.
        self._gathers.pop(stage, None)
        self._full.discard(stage)
        self._reshards_done[stage] += 1
        final = self._reshards_done[stage] == self._last_reshard[stage]
        sync = None
        if final and self._reduce_grads:
            sync = _GradSync(stage)
            self._grad_syncs.append(sync)
        return FsdpJob(step, partial(self._reshard, step, sync))

    def install_before(self, step: MetaStep) -> FsdpJob | None:
        """Before compute leaf ``step``: the job that installs its stage's gathered
        parameters, or None when they are installed already. Raises RuntimeError when
        they are sharded and no all-gather was issued."""
        stage = self._stage(step)
        issued = self._gathers.pop(stage, None)
        if issued is None:
            if stage not in self._full:
                raise RuntimeError(
                    f"{step.short()} needs the full parameters of stage {stage}, but they "
                    "are sharded: no FSDP_UNSHARD was issued for this use"
                )
            return None
        self._full.add(stage)
        unshard, reply = issued
        arrival = reply.arrival
        assert arrival is not None
        return FsdpJob(unshard, partial(self._install, stage, arrival), arrival)

    def _stage(self, step: MetaStep) -> int:
        if step.stage not in self._states:
            raise ValueError(f"{step.short()}: rank {self.rank} holds no stage {step.stage}")
        if self._post is None:
            self._post = loop_caller()
        return step.stage

    # -- compute-thread jobs ----------------------------------------------------------------
    def _unshard(self, step: MetaStep, reply: ReplyFuture[Gathered]) -> None:
        flat = self._states[step.stage].snapshot_shard()
        key = f"unshard.s{step.stage}"
        self._issue(CollectiveRequest(step, "all_gather", self._group, key, (flat,), reply))

    def _install(self, stage: int, arrival: Arrival) -> None:
        gathered: Gathered = arrival.wait(0.0)  # the batch waited for it
        self._states[stage].install_full(gathered)
        self._note(self._measure())

    def _reshard(self, step: MetaStep, sync: _GradSync | None) -> None:
        stage = step.stage
        state = self._states[stage]
        if sync is not None:
            pipeline_stage = self._stages[stage]
            sync.buckets = state.grad_buckets(pipeline_stage.parameters, pipeline_stage.grads)
            sync.kept = state.kept_grads(pipeline_stage.parameters, pipeline_stage.grads)
        state.reshard()
        self._note(self._measure())
        if sync is None:
            return
        for bucket in sync.buckets:
            op: CollectiveOp = "reduce_scatter_sum"
            key = f"grads.s{stage}.{bucket.dtype}"
            reply: ReplyFuture[Gathered] = ReplyFuture(f"{op} {key}")
            sync.replies.append(reply)
            self._issue(CollectiveRequest(step, op, self._group, key, bucket.contributions, reply))
            self._reduce_scatters += 1
        if len(self._expert_group) > 1:
            for index, grad in sync.kept.items():
                key = f"experts.s{stage}.p{index}"
                gathered: ReplyFuture[Gathered] = ReplyFuture(f"all_gather {key}")
                sync.kept_replies[index] = gathered
                request = CollectiveRequest(
                    step, "all_gather", self._expert_group, key, (grad,), gathered
                )
                self._issue(request)

    def _issue(self, request: CollectiveRequest) -> None:
        """Compute thread: hand ``request`` to the P2P actor on the event loop."""
        assert self._post is not None
        self._post(self._send, request)

    def _send(self, request: CollectiveRequest) -> None:
        """Event loop: post a collective; a failure to post fails its reply (whoever
        waits for it raises)."""
        try:
            self._p2p.send_nowait(request)
        except Exception as exc:
            request.reply.fail(exc)

    def _install_grads(
        self,
        syncs: list[_GradSync],
        sums: list[list[npt.NDArray[Any]]],
        kept: list[dict[int, npt.NDArray[Any]]],
    ) -> None:
        for sync, stage_sums, stage_kept in zip(syncs, sums, kept, strict=True):
            stage = self._stages[sync.stage]
            state = self._states[sync.stage]
            grads = state.shard_grads(stage.parameters, sync.buckets, stage_sums, stage_kept)
            stage.replace_grads(grads)
        self._note(self._measure())

    def _measure(self) -> int:
        return sum(state.resident_bytes() for state in self._states.values())

    def _note(self, resident: int) -> None:
        self._resident = resident
        self._peak = max(self._peak, resident)

    # -- after the order (event loop) -------------------------------------------------------
    async def _expert_sum(self, reply: ReplyFuture[Gathered]) -> npt.NDArray[Any]:
        """The sum, in group order, of an expert gradient's all-gather."""
        parts = await reply.wait(self._timeout_s)
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        return total

    async def finish(self) -> int:
        """After the order: await the gradient reduce-scatters, then install every
        stage's shard gradients in one compute-thread job; the jobs run (0 or 1)."""
        if self._full:
            raise RuntimeError(
                f"stages {sorted(self._full)} of rank {self.rank} are still unsharded at the "
                "end of the order (an FSDP_UNSHARD without its FSDP_RESHARD)"
            )
        syncs, self._grad_syncs = self._grad_syncs, []
        sums = [
            [(await reply.wait(self._timeout_s))[0] for reply in sync.replies] for sync in syncs
        ]
        kept = [
            {
                index: await self._expert_sum(sync.kept_replies[index])
                if index in sync.kept_replies
                else grad
                for index, grad in sync.kept.items()
            }
            for sync in syncs
        ]
        if not syncs:
            return 0
        with anyio.move_on_after(self._timeout_s):
            await self._compute.run(self._install_grads, syncs, sums, kept)
            return 1
        raise FutureTimeoutError(
            f"compute job FsdpRankDriver._install_grads still running after {self._timeout_s}s"
        )
