"""ExpertRunner: a rank's expert parallelism during one run.

Made by the rank (``ppswap.actors.rank``) when a stage of it holds MoE blocks. ``bind``
(event loop, as the rank's compute actor starts) gives every block of its stages an
``ExpertExchange`` over the rank's EP group (``DeviceMesh.ep_group``), through the rank's
P2P channel, under a key per stage and block (``s{stage}.b{n}``); ``close`` (as it ends)
unbinds them and abandons a body still suspended. ``wrap`` (event loop, as a batch is
built) turns the compute job of a leaf of such a stage into one that tells the exchange
which step it is at and runs the body as a ``Fiber`` that gives the thread up while an
all-to-all is in flight (``Suspended``): the batch runs the other leaf of its composite
meanwhile (the all-to-all of FWD j overlaps the compute of BWD i), and, where the ranks
of the process share the compute thread, parks and lets the thread serve the other
ranks, among them the peers of the exchange.

A stage whose blocks cannot run in fibers (``ExpertBlock.runs_in_fibers``: MindSpore)
blocks its compute thread in its exchanges; it runs with one rank per process only, and
its composites run their leaves in order (``batch_pairs``): EP peers that ran one in
opposite orders (each the leaf whose input came first) would wait on each other.

The load-balancing loss (a block's ``aux_loss_coef > 0``) needs a runner whether or not
the run splits experts (``mesh`` None, or ``ep`` 1: no exchange, no fiber): ``bind``
gives each such block the run's gradient scale (``aux_grad_scale``, the backward seed
``loss_scale / micro_batch_num``; 0 in a forward-only run) and a record of its term per
micro-batch (a recomputed forward's term replaces the first's: the same value);
``aux_loss`` is their mean over the micro-batches, summed over the blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, Protocol

from ppswap.backends import backend_for
from ppswap.core.arrival import Arrival
from ppswap.core.executor import loop_caller
from ppswap.core.fiber import Fiber
from ppswap.core.messages import RequestSink
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.moe.exchange import ExpertExchange
from ppswap.moe.split import expert_blocks
from ppswap.scheduler.steps import MetaStep, StepKind
from ppswap.stage import PipelineStage

__all__ = ["ExpertRunner"]


class StepJobLike(Protocol):
    """What ``batch_pairs`` reads of a batch's job (``ppswap.actors.batch.StepJob``)."""

    @property
    def step(self) -> MetaStep: ...


class ExpertRunner:
    """World rank ``rank``'s MoE blocks during a run (module docstring). ``mesh``: the
    run's, None without one (the experts are split where ``mesh.ep > 1``). ``shared``:
    the compute thread is shared by the ranks of this process (every stage whose experts
    are split must run its bodies as fibers)."""

    def __init__(
        self,
        *,
        rank: int,
        mesh: DeviceMesh | None,
        stages: Mapping[int, PipelineStage],
        sink: RequestSink,
        shared: bool,
        aux_grad_scale: float = 0.0,
        timeout_s: float = math.inf,
        dump: Callable[[], str] | None = None,
    ) -> None:
        self.rank = rank
        self._group = None if mesh is None or mesh.ep == 1 else mesh.ep_group(rank)
        self._blocks = {
            index: expert_blocks(stage.module)
            for index, stage in stages.items()
            if expert_blocks(stage.module)
        }
        self._fibers = (
            {}
            if self._group is None
            else {
                index: all(block.runs_in_fibers for block in blocks)
                for index, blocks in self._blocks.items()
            }
        )
        self._aux_grad_scale = aux_grad_scale
        self._aux_terms: dict[tuple[int, int, int], Any] = {}  # (stage, block, micro)
        self._aux_stages = frozenset(
            index
            for index, blocks in self._blocks.items()
            if any(block.aux_loss_coef for block in blocks)
        )
        if shared and not all(self._fibers.values()):
            blocked = sorted(index for index, fibers in self._fibers.items() if not fibers)
            raise ValueError(
                f"rank {rank}: the MoE blocks of stages {blocked} cannot run in fibers, so "
                "their ranks cannot share a process's compute thread"
            )
        if not self._blocks:
            raise ValueError(f"rank {rank}: none of stages {sorted(stages)} holds a MoE block")
        self._backend = backend_for(stages[min(self._blocks)].module)
        self._sink = sink
        self._timeout_s = timeout_s
        self._dump = dump
        self._step = MetaStep(StepKind.FWD, -1, -1)
        self._fiber: Fiber | None = None  # the one running now, if any
        self._live: dict[Fiber, None] = {}  # started and not finished (suspended)
        self.exchange: ExpertExchange | None = None

    @staticmethod
    def needed(mesh: DeviceMesh | None, stages: Sequence[PipelineStage]) -> bool:
        """Whether a rank with ``stages`` needs a runner: a stage holds MoE blocks and the
        mesh splits experts, or a block has a load-balancing loss."""
        blocks = [block for stage in stages for block in expert_blocks(stage.module)]
        split = mesh is not None and mesh.ep > 1
        return bool(blocks) and (split or any(block.aux_loss_coef for block in blocks))

    @property
    def stages(self) -> frozenset[int]:
        """The stage indices that hold MoE blocks."""
        return frozenset(self._blocks)

    def bind(self) -> None:
        """Event loop, before the order: route every block over this rank's EP group (if
        the experts are split) and bind the load-balancing terms (module docstring)."""
        if self._group is not None:
            self.exchange = ExpertExchange(
                rank=self.rank,
                group=self._group,
                post=loop_caller(),
                sink=self._sink,
                where=self._where,
                timeout_s=self._timeout_s,
                suspend=self._suspend,
                dump=self._dump,
            )
        for stage, blocks in self._blocks.items():
            for number, block in enumerate(blocks):
                if self.exchange is not None:
                    block.bind_exchange(self.exchange, f"s{stage}.b{number}")
                if block.aux_loss_coef:
                    block.bind_aux(self._aux_grad_scale, partial(self._record_aux, stage, number))

    def close(self) -> None:
        """After the order (or a failure): unbind the blocks; abandon a suspended body."""
        for blocks in self._blocks.values():
            for block in blocks:
                block.bind_exchange(None)
                block.bind_aux(0.0, None)
        for fiber in self._live:
            fiber.abandon()
        self._live.clear()
        self._fiber = None

    def wrap(self, step: MetaStep, run: Callable[[], Any]) -> Callable[[], Any]:
        """The body of compute leaf ``step`` as the batch runs it (module docstring);
        ``run`` itself for a stage without MoE blocks."""
        if step.stage not in self._fibers:
            return _Stepped(self, step, run) if step.stage in self._aux_stages else run
        if not self._fibers[step.stage]:
            return _Stepped(self, step, run)
        return _FiberBody(self, step, run)

    def aux_loss(self) -> float:
        """After the run: each block's load-balancing term, mean over the micro-batches
        it ran, summed over the blocks (0.0 without such a block)."""
        if not self._aux_terms:
            return 0.0
        keys = sorted(self._aux_terms)
        values = self._backend.host_floats([self._aux_terms[key] for key in keys])
        by_block: dict[tuple[int, int], list[float]] = {}
        for (stage, number, _), value in zip(keys, values, strict=True):
            by_block.setdefault((stage, number), []).append(value)
        return sum(sum(terms) / len(terms) for terms in by_block.values())

    def _record_aux(self, stage: int, number: int, term: Any) -> None:
        """Compute thread: block ``number`` of ``stage``'s term in the step running now."""
        self._aux_terms[(stage, number, self._step.micro)] = self._backend.keep_scalar(term)

    def batch_pairs(
        self,
        jobs: Sequence[StepJobLike],
        composites: Sequence[MetaStep],
        pairs: frozenset[int],
        parks: bool,
    ) -> frozenset[int]:
        """A batch's pairs (``BatchRun.pairs``) for this rank's MoE stages: every
        composite of MoE leaves that run in fibers is a pair, whether its inputs are
        there or not, so that a leaf suspended in an exchange lets its partner run; a
        composite of MoE leaves that block in their exchanges (not in fibers) is none on
        a rank alone in its process (``parks`` False): it runs in its order (module
        docstring)."""
        if self._group is None:
            return pairs
        fibers = {index for index, runs in self._fibers.items() if runs}
        blocking = set(self._fibers) - fibers
        leaves = {composite.sub_steps for composite in composites}
        found = set(pairs)
        for i in range(len(jobs) - 1):
            first, second = jobs[i].step, jobs[i + 1].step
            stages = {first.stage, second.stage}
            if (first, second) in leaves and stages & fibers:
                found.add(i)
            if not parks and stages & blocking:
                found.discard(i)
        return frozenset(found)

    def _where(self) -> MetaStep:
        return self._step

    def _suspend(self, arrival: Arrival) -> bool:
        """Give the thread up until ``arrival`` is there: True from a fiber; False from a
        body that runs on the compute thread itself (it blocks in the wait)."""
        fiber = self._fiber
        if fiber is None:
            return False
        fiber.suspend(arrival)
        return True


class _Stepped:
    """A body that names its step to the exchange, then runs on the compute thread (it
    blocks in its exchanges: a stage whose blocks cannot run in fibers)."""

    __slots__ = ("_run", "_runner", "_step")

    def __init__(self, runner: ExpertRunner, step: MetaStep, run: Callable[[], Any]) -> None:
        self._runner, self._step, self._run = runner, step, run

    def __call__(self) -> Any:
        self._runner._step = self._step
        return self._run()


class _FiberBody:
    """A body run as a fiber: each call runs it on until it returns or suspends."""

    __slots__ = ("_fiber", "_run", "_runner", "_step")

    def __init__(self, runner: ExpertRunner, step: MetaStep, run: Callable[[], Any]) -> None:
        self._runner, self._step, self._run = runner, step, run
        self._fiber: Fiber | None = None

    def __call__(self) -> Any:
        runner = self._runner
        if self._fiber is None:
            name = f"ppswap-moe-rank{runner.rank}-{self._step.short()}"
            self._fiber = Fiber(self._run, name, runner._timeout_s * 2)
            runner._live[self._fiber] = None
        runner._step, runner._fiber = self._step, self._fiber
        try:
            return self._fiber.step()
        finally:
            runner._fiber = None
            if self._fiber.done:
                runner._live.pop(self._fiber, None)
