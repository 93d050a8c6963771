"""TIED_GRAD_SUM at run time: the step that makes each holder's tied gradient whole.

A tie (``ppswap.planning.ties``) is summed by a TIED_GRAD_SUM step at the end of each
holder rank's order (``ppswap.scheduler.ties``), run by the rank's compute actor on its
one path, as two jobs of one batch (``StepJob``), the step beginning its batch:

1. the *gather* job (``TIE_GATHER_JOB``, not a step of its own) hands this rank's shares
   over: where the tie's holder ranks are in several processes it copies this rank's
   holders' gradients to the host, packs them (``core.packed``, every tie of the step in
   one array) and posts one ``all_gather`` among the holder ranks to the rank's P2P actor
   through the event loop (``loop_caller``: never blocking the thread or the loop); where
   they are all in this process it checks this rank in at the tie's meeting (``_Meeting``),
   and the last rank to arrive adds every holder's gradient with the framework;
2. the *sum* job (``TIED_SUM_JOB``, the step) waits on the compute thread for the
   all-gather's reply or the meeting (an ``Arrival``, with the step deadline: blocking
   when the rank is alone in its process, parked when ranks share the thread), adds the
   gathered gradients in stage order (numpy, as the transports' ``reduce_scatter_sum``)
   and installs the sum as every holder's gradient on this rank.

Either way the shares are added in stage order (stage index ascending), so every holder
gets the same bits, the same as a run in one process. One tensor per parameter object:
holders of one object share it (torch's ``.grad`` gets the sum once,
``grads_to_give``); distinct copies each get their own (an optimizer may change a
gradient in place). With FSDP the step's batch runs after the rank's gradient
reduce-scatters are installed, so the tie's shard gradients are summed shard-wise.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from ppswap.actors.batch import StepJob
from ppswap.backends.base import Backend
from ppswap.backends.types import HostArray, Tensor
from ppswap.core.arrival import Arrival
from ppswap.core.dtypes import BFLOAT16, is_bfloat16
from ppswap.core.executor import loop_caller
from ppswap.core.messages import CollectiveRequest, ReplyFuture, RequestSink
from ppswap.core.packed import pack, unpack
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.planning.ties import TieGroup, TieHolder, Ties, world_rank_of
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import TIED_GRAD_SUM, MetaStep
from ppswap.stage_run import StageRun, StageRuns

__all__ = [
    "TIED_SUM_JOB",
    "TIE_GATHER_JOB",
    "TieRankDriver",
    "TieSums",
    "grads_to_give",
]

TIE_GATHER_JOB = "tie_gather"
"""The first job of a TIED_GRAD_SUM (the rank's shares handed over): no step of its own,
drawn as part of the step's span."""
TIED_SUM_JOB = "tied_grad_sum"
"""The job that is the TIED_GRAD_SUM step: the sum installed."""

Gathered = tuple[HostArray, ...]


_Installs = list[tuple[StageRun, int, Tensor]]
"""Per holder: its stage's gradients, the parameter's index there, its new gradient."""


@dataclass(slots=True, eq=False)
class _Meeting:
    """Where the TIED_GRAD_SUM steps of the holder ranks of ``groups`` (one stage set
    and dp replica, every holder in this process) meet: per member rank its ``Arrival``,
    and what its holders get. Compute thread only: the ranks of a process share its one
    compute thread."""

    groups: tuple[TieGroup, ...]
    arrivals: dict[int, Arrival]
    arrived: set[int] = field(default_factory=set)
    installs: dict[int, _Installs] = field(default_factory=dict)


class TieSums:
    """The TIED_GRAD_SUM work of one run in this process: ``ties`` (this process's
    holders), ``groups`` (every tie of the run), ``runs`` (the gradients of each stage of
    this process during the run), and the meetings of the ties whose holder ranks are all
    here. ``distributed``: one process per rank, so a tie held on several ranks is an
    all-gather among them."""

    def __init__(
        self,
        ties: Ties,
        groups: Sequence[TieGroup],
        backend: Backend,
        config: ScheduleConfig,
        mesh: DeviceMesh | None,
        runs: StageRuns,
        *,
        distributed: bool,
    ) -> None:
        self.ties = ties
        self.backend = backend
        self.config = config
        self.mesh = mesh
        self.runs = runs
        self.distributed = distributed
        self._groups = tuple(groups)
        self._stage_sets = sorted({g.stages for g in groups})
        self._meetings: dict[tuple[tuple[int, ...], int], _Meeting] = {}

    def steps_of(self, rank: int) -> list[tuple[MetaStep, tuple[TieGroup, ...]]]:
        """World rank ``rank``'s TIED_GRAD_SUM steps, in its order's order (as
        ``scheduler.ties.with_tie_steps`` appends them), each with the ties it sums."""
        pipeline_rank = rank % self.config.pp
        replica = 0 if self.mesh is None else rank // self.mesh.pp
        steps = []
        for stages in self._stage_sets:
            mine = [s for s in stages if self.config.rank_of(s) == pipeline_rank]
            if mine:
                groups = tuple(
                    g for g in self._groups if g.stages == stages and g.replica == replica
                )
                steps.append((MetaStep(TIED_GRAD_SUM, mine[-1], -1), groups))
        return steps

    def driver(self, rank: int, sink: RequestSink) -> TieRankDriver | None:
        """The TIED_GRAD_SUM jobs of world rank ``rank`` (collectives posted to ``sink``,
        its P2P channel), or None where its order has none."""
        steps = self.steps_of(rank)
        return TieRankDriver(self, rank, steps, sink) if steps else None

    def meeting(self, rank: int, groups: tuple[TieGroup, ...]) -> _Meeting:
        """The meeting of ``groups`` (one stage set and replica; none: ``rank`` alone)."""
        ranks = groups[0].ranks if groups else (rank,)
        key = (groups[0].stages, groups[0].replica) if groups else ((), -1 - rank)
        found = self._meetings.get(key)
        if found is None:
            arrivals = {r: Arrival(f"the tied gradients of ranks {list(ranks)}") for r in ranks}
            found = self._meetings[key] = _Meeting(groups, arrivals)
        return found

    def holder_rank(self, holder: TieHolder) -> int:
        return world_rank_of(self.config, self.mesh, holder.copy)

    def holders(self, group: TieGroup) -> tuple[TieHolder, ...]:
        """This process's holders of ``group``, in stage order."""
        return self.ties.local.get((group.key, group.replica), ())

    def grad_of(self, holder: TieHolder) -> Tensor:
        """Compute thread: the run's gradient of ``holder`` (zeros where it got none)."""
        param, grad = self.runs[holder.stage].run_grads()[holder.index]
        return self.backend.zeros_like(param) if grad is None else grad

    def installs(self, group: TieGroup, made: Callable[[Tensor, bool], Tensor]) -> _Installs:
        """Per holder of ``group`` in this process, the tensor it gets: ``made(param,
        first)`` once per parameter object (``first``: the group's first object), shared
        by the holders of that object."""
        by_object: dict[int, Tensor] = {}
        out: _Installs = []
        for holder in self.holders(group):
            run = self.runs[holder.stage]
            param = run.parameters[holder.index]
            tensor = by_object.get(id(param))
            if tensor is None:
                tensor = by_object[id(param)] = made(param, not by_object)
            out.append((run, holder.index, tensor))
        return out


class TieRankDriver:
    """One rank's TIED_GRAD_SUM steps (module docstring): ``jobs(step)`` runs on the
    event loop while the compute actor builds the step's batch; the jobs it returns run
    on the compute thread."""

    def __init__(
        self,
        sums: TieSums,
        rank: int,
        steps: Sequence[tuple[MetaStep, tuple[TieGroup, ...]]],
        sink: RequestSink,
    ) -> None:
        self.rank = rank
        self._sums = sums
        self._steps = deque(steps)
        self._sink = sink
        self._post: Callable[..., None] | None = None  # loop_caller(), made on the loop

    def jobs(self, step: MetaStep) -> tuple[StepJob, StepJob]:
        """The gather and the sum job of TIED_GRAD_SUM ``step``. RuntimeError for a step
        the plan did not give this rank."""
        if not self._steps:
            raise RuntimeError(f"{step.short()}: rank {self.rank} has no tie left to sum")
        expected, groups = self._steps.popleft()
        if step != expected:
            raise RuntimeError(
                f"{step.short()}: rank {self.rank}'s next tied sum is {expected.short()}"
            )
        ranks = groups[0].ranks if groups else (self.rank,)
        if self._sums.distributed and len(ranks) > 1:
            return self._collective_jobs(step, groups, ranks)
        meeting = self._sums.meeting(self.rank, groups)
        arrival = meeting.arrivals[self.rank]
        gather = StepJob(step, TIE_GATHER_JOB, partial(self._arrive, meeting))
        total = StepJob(step, TIED_SUM_JOB, partial(self._install_met, meeting), arrival=arrival)
        return gather, total

    # -- every holder rank in this process: the meeting -----------------------------------
    def _arrive(self, meeting: _Meeting) -> None:
        """Compute thread: this rank's shares are complete; the last rank to arrive sums
        every tie of the meeting and lets every member go on."""
        meeting.arrived.add(self.rank)
        if len(meeting.arrived) < len(meeting.arrivals):
            return
        sums = self._sums
        try:
            for group in meeting.groups:
                ranks = [sums.holder_rank(holder) for holder in sums.holders(group)]
                installs = _framework_sum(sums, group)
                for rank, install in zip(ranks, installs, strict=True):
                    meeting.installs.setdefault(rank, []).append(install)
        except Exception as exc:
            for rank, arrival in meeting.arrivals.items():
                if rank != self.rank:
                    arrival.land(None, exc)
            raise
        for arrival in meeting.arrivals.values():
            arrival.land(None)

    def _install_met(self, meeting: _Meeting) -> None:
        """Compute thread, after the meeting: this rank's holders get their sums."""
        meeting.arrivals[self.rank].wait(0.0)  # raises the summing rank's error, if any
        _install(meeting.installs.get(self.rank, []))

    # -- holder ranks in several processes: one all-gather --------------------------------
    def _collective_jobs(
        self, step: MetaStep, groups: tuple[TieGroup, ...], ranks: tuple[int, ...]
    ) -> tuple[StepJob, StepJob]:
        if self._post is None:
            self._post = loop_caller()
        first = groups[0]
        key = f"tied.r{first.replica}.s{'-'.join(map(str, first.stages))}"
        label = f"all_gather {key}"
        arrival = Arrival(label)
        reply: ReplyFuture[Gathered] = ReplyFuture(label, arrival)
        request = partial(CollectiveRequest, step, "all_gather", ranks, key, reply=reply)
        gather = StepJob(step, TIE_GATHER_JOB, partial(self._post_shares, groups, request))
        install = partial(self._install_gathered, groups, ranks, arrival)
        return gather, StepJob(step, TIED_SUM_JOB, install, arrival=arrival)

    def _post_shares(
        self, groups: tuple[TieGroup, ...], request: Callable[..., CollectiveRequest]
    ) -> None:
        """Compute thread: this rank's holders' gradients (ties in order, each in stage
        order) as one packed host array, all-gathered among the holder ranks."""
        sums = self._sums
        parts = [
            sums.backend.to_host(sums.grad_of(holder), copy=True)
            for group in groups
            for holder in sums.holders(group)
        ]
        assert self._post is not None
        self._post(self._send, request(payload=(pack(parts),)))

    def _send(self, request: CollectiveRequest) -> None:
        """Event loop: post the all-gather; a failure to post fails its reply (the sum
        job, waiting for it, raises)."""
        try:
            self._sink.send_nowait(request)
        except Exception as exc:
            request.reply.fail(exc)

    def _install_gathered(
        self, groups: tuple[TieGroup, ...], ranks: tuple[int, ...], arrival: Arrival
    ) -> None:
        """Compute thread, once the all-gather is back: per tie the sum of every
        holder's gradient in stage order (numpy), installed on this rank's holders."""
        gathered: Gathered = arrival.wait(0.0)  # the batch waited for it
        sums = self._sums
        rows: dict[tuple[int, int], HostArray] = {}  # (tie, stage) -> its gradient
        for rank, packed in zip(ranks, gathered, strict=True):
            held = [
                (index, copy.stage)
                for index, group in enumerate(groups)
                for copy in group.copies
                if world_rank_of(sums.config, sums.mesh, copy) == rank
            ]
            parts = unpack(packed)
            if len(parts) != len(held):
                raise ValueError(
                    f"tied {[g.key for g in groups]}: rank {rank} sent {len(parts)} "
                    f"gradients, expected {len(held)} (ties and stages {held})"
                )
            for where, part in zip(held, parts, strict=True):
                assert part is not None
                bf16 = BFLOAT16 is not None and is_bfloat16(part.dtype)
                rows[where] = part.view(BFLOAT16) if bf16 else part
        installs: _Installs = []
        for index, group in enumerate(groups):
            ordered = [rows[(index, stage)] for stage in group.stages]
            total = ordered[0].copy()
            for row in ordered[1:]:
                total += row
            installs += sums.installs(group, partial(_from_host, sums.backend, total))
        _install(installs)


def _from_host(backend: Backend, total: HostArray, param: Tensor, first: bool) -> Tensor:
    return backend.from_host(total.copy(), like=param)


def _framework_sum(sums: TieSums, group: TieGroup) -> _Installs:
    """Compute thread: the sum of every holder's gradient of ``group`` (all in this
    process) in stage order, by the framework; per holder what it gets (the sum itself
    for the first parameter object, a copy of it for each other)."""
    backend = sums.backend
    total: Tensor = None
    for holder in sums.holders(group):
        grad = sums.grad_of(holder)
        total = grad if total is None else total + grad

    def made(param: Tensor, first: bool) -> Tensor:
        if first:
            return total
        return backend.from_payload(backend.to_payload(total, copy=True, host=False), like=param)

    return sums.installs(group, made)


def _install(installs: _Installs) -> None:
    """Compute thread: each holder's gradient replaced by its tensor (each stage's
    gradients replaced once)."""
    replaced: dict[int, tuple[StageRun, list[Tensor]]] = {}
    for run, index, tensor in installs:
        if id(run) not in replaced:
            replaced[id(run)] = (run, [grad for _, grad in run.run_grads()])
        replaced[id(run)][1][index] = tensor
    for run, grads in replaced.values():
        run.replace_grads(grads)


def grads_to_give(
    stages: Sequence[StageRun],
) -> tuple[list[Tensor], list[Tensor | None]]:
    """Every stage's ``(parameter, gradient)`` pairs, each parameter object once (its
    first stage's: after TIED_GRAD_SUM every holder's is the whole sum), as
    ``Backend.give_grads`` takes them."""
    params: list[Tensor] = []
    grads: list[Tensor | None] = []
    seen: set[int] = set()
    for stage in stages:
        for param, grad in stage.run_grads():
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
                grads.append(grad)
    return params, grads
