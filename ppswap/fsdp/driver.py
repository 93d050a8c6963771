"""FsdpRankDriver: one rank's FSDP_UNSHARD / FSDP_RESHARD work, driven by its compute actor.

The compute actor hands every FSDP step to ``run_step`` and calls ``before_compute`` before
each compute leaf and ``finish`` after the last step. Collectives go to the rank's P2P
actor as ``CollectiveRequest`` messages (the P2P lane of the trace shows them as
``all_gather unshard.s{stage}`` and ``reduce_scatter_sum grads.s{stage}.{dtype}``);
tensor work runs on the compute thread (``DedicatedThread``), one hop per step.

- FSDP_UNSHARD(s): snapshot the local shards (one flat byte array per stage) and *issue*
  the all-gather; the step returns at once. The plan's one-step lookahead therefore lets
  the all-gather run under the preceding compute slot.
- before a compute leaf of stage s: if an all-gather of s is in flight, await its reply
  (step deadline) and install the full parameters. The first leaf of a use run is the
  point where the data must be there; the leaf's own forward/backward then sees the full
  parameters. (Probe, mindspore 2.10 CPU: a recorded forward reads the *current* data of
  its Parameters at backward time, so FWD may run on one gathered copy and BWD on a later,
  re-gathered one; gradients are bit-identical to never resharding.)
- FSDP_RESHARD(s): install the kept shards (the full storage is released). After the
  stage's *last* RESHARD of the order (its last backward is done) the gradients are split
  into per-member rows and a reduce-scatter (sum) is issued; ``finish`` awaits it and sets
  ``stage.grads`` to the shard gradients divided by ``dp`` (each replica seeds its backward
  with ``1 / micro``, so this is the gradient of the mean loss over the global batch).
- Parameter memory is measured from the real storages after every install and reshard.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import numpy.typing as npt

from ppswap.core.executor import DedicatedThread
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
from ppswap.stage import PipelineStage

__all__ = ["FsdpRankDriver", "FsdpStats"]

T = TypeVar("T")
Gathered = tuple[npt.NDArray[Any], ...]


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
    stage: int
    buckets: list[GradBucket]
    replies: list[ReplyFuture[Gathered]]


class FsdpRankDriver:
    """Runs the FSDP steps of world rank ``rank`` over its fully_shard()-ed ``stages``."""

    def __init__(
        self,
        *,
        rank: int,
        mesh: DeviceMesh,
        order: Order,
        stages: Mapping[int, PipelineStage],
        compute: DedicatedThread,
        p2p: RequestSink,
        timeout_s: float = math.inf,
        reduce_grads: bool = True,
    ) -> None:
        self.rank = rank
        self._group = mesh.dp_group(rank)
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
        self._gathers: dict[int, ReplyFuture[Gathered]] = {}
        self._grad_syncs: list[_GradSync] = []
        self._locks = {index: anyio.Lock() for index in self._stages}
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

    # -- compute-thread jobs -------------------------------------------------------------------
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

    def _measure(self) -> int:
        return sum(state.resident_bytes() for state in self._states.values())

    def _install(self, stage: int, gathered: Gathered) -> int:
        self._states[stage].install_full(gathered)
        return self._measure()

    def _reshard(self, stage: int, with_grads: bool) -> tuple[list[GradBucket], int]:
        state = self._states[stage]
        buckets: list[GradBucket] = []
        if with_grads:
            pipeline_stage = self._stages[stage]
            buckets = state.grad_buckets(pipeline_stage.parameters, pipeline_stage.grads)
        state.reshard()
        return buckets, self._measure()

    def _install_grads(self, sync: _GradSync, sums: list[npt.NDArray[Any]]) -> int:
        stage = self._stages[sync.stage]
        grads = self._states[sync.stage].shard_grads(stage.parameters, sync.buckets, sums)
        stage.replace_grads(grads)
        return self._measure()

    def _note(self, resident: int) -> None:
        self._resident = resident
        self._peak = max(self._peak, resident)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        with anyio.move_on_after(self._timeout_s):
            return await self._compute.run(fn, *args)
        name = getattr(fn, "__qualname__", repr(fn))
        raise FutureTimeoutError(f"compute job {name} still running after {self._timeout_s}s")

    async def _collective(
        self, step: MetaStep, op: CollectiveOp, key: str, payload: Gathered
    ) -> ReplyFuture[Gathered]:
        reply: ReplyFuture[Gathered] = ReplyFuture(f"{op} {key}")
        await self._p2p.send(CollectiveRequest(step, op, self._group, key, payload, reply))
        return reply

    # -- the FsdpDriver protocol (event loop) ----------------------------------------------------
    async def run_step(self, step: MetaStep) -> None:
        """FSDP_UNSHARD: issue the all-gather. FSDP_RESHARD: drop the full parameters (and,
        after the stage's last use, issue the gradient reduce-scatter)."""
        stage = step.stage
        state = self._states.get(stage)
        if state is None:
            raise ValueError(f"{step.short()}: rank {self.rank} holds no stage {stage}")
        async with self._locks[stage]:
            if step.kind is StepKind.FSDP_UNSHARD:
                if state.unsharded:
                    raise RuntimeError(
                        f"{step.short()}: stage {stage} is already unsharded (an UNSHARD "
                        "without a RESHARD before it)"
                    )
                flat = await self._call(state.snapshot_shard)
                self._gathers[stage] = await self._collective(
                    step, "all_gather", f"unshard.s{stage}", (flat,)
                )
                self._all_gathers += 1
                return
            if step.kind is not StepKind.FSDP_RESHARD:
                raise ValueError(f"FSDP driver got a {step.kind.value} step")
            # An all-gather nobody consumed (a run without compute): drop it; the kept
            # shard is the state to return to.
            self._gathers.pop(stage, None)
            self._reshards_done[stage] += 1
            final = self._reshards_done[stage] == self._last_reshard[stage]
            with_grads = final and self._reduce_grads
            buckets, resident = await self._call(self._reshard, stage, with_grads)
            self._note(resident)
            if buckets:
                replies = [
                    await self._collective(
                        step, "reduce_scatter_sum", f"grads.s{stage}.{b.dtype}", b.contributions
                    )
                    for b in buckets
                ]
                self._reduce_scatters += len(replies)
                self._grad_syncs.append(_GradSync(stage, buckets, replies))

    async def before_compute(self, step: MetaStep) -> None:
        """Before a compute leaf of ``step.stage``: its full parameters must be installed."""
        stage = step.stage
        state = self._states.get(stage)
        if state is None:
            raise ValueError(f"{step.short()}: rank {self.rank} holds no stage {stage}")
        async with self._locks[stage]:
            reply = self._gathers.pop(stage, None)
            if reply is None:
                if not state.unsharded:
                    raise RuntimeError(
                        f"{step.short()} needs the full parameters of stage {stage}, but they "
                        "are sharded: no FSDP_UNSHARD was issued for this use"
                    )
                return
            gathered = await reply.wait(self._timeout_s)
            self._note(await self._call(self._install, stage, gathered))

    async def finish(self) -> None:
        """After the order: await the gradient reduce-scatters, install the shard grads."""
        still_unsharded = sorted(s for s, state in self._states.items() if state.unsharded)
        if still_unsharded:
            raise RuntimeError(
                f"stages {still_unsharded} of rank {self.rank} are still unsharded at the end "
                "of the order (an FSDP_UNSHARD without its FSDP_RESHARD)"
            )
        for sync in self._grad_syncs:
            sums = [(await reply.wait(self._timeout_s))[0] for reply in sync.replies]
            self._note(await self._call(self._install_grads, sync, sums))
        self._grad_syncs.clear()
