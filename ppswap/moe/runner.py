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
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

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
    """World rank ``rank``'s MoE blocks during a run (module docstring). ``shared``: the
    compute thread is shared by the ranks of this process (every stage must run its
    bodies as fibers)."""

    def __init__(
        self,
        *,
        rank: int,
        mesh: DeviceMesh,
        stages: Mapping[int, PipelineStage],
        sink: RequestSink,
        shared: bool,
        timeout_s: float = math.inf,
        dump: Callable[[], str] | None = None,
    ) -> None:
        self.rank = rank
        self._group = mesh.ep_group(rank)
        self._blocks = {
            index: expert_blocks(stage.module)
            for index, stage in stages.items()
            if expert_blocks(stage.module)
        }
        self._fibers = {
            index: all(block.runs_in_fibers for block in blocks)
            for index, blocks in self._blocks.items()
        }
        if shared and not all(self._fibers.values()):
            blocked = sorted(index for index, fibers in self._fibers.items() if not fibers)
            raise ValueError(
                f"rank {rank}: the MoE blocks of stages {blocked} cannot run in fibers, so "
                "their ranks cannot share a process's compute thread"
            )
        self._sink = sink
        self._timeout_s = timeout_s
        self._dump = dump
        self._step = MetaStep(StepKind.FWD, -1, -1)
        self._fiber: Fiber | None = None  # the one running now, if any
        self._live: dict[Fiber, None] = {}  # started and not finished (suspended)
        self.exchange: ExpertExchange | None = None

    @property
    def stages(self) -> frozenset[int]:
        """The stage indices that hold MoE blocks."""
        return frozenset(self._blocks)

    def bind(self) -> None:
        """Event loop, before the order: route every block over this rank's EP group."""
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
                block.bind_exchange(self.exchange, f"s{stage}.b{number}")

    def close(self) -> None:
        """After the order (or a failure): unbind the blocks; abandon a suspended body."""
        for blocks in self._blocks.values():
            for block in blocks:
                block.bind_exchange(None)
        for fiber in self._live:
            fiber.abandon()
        self._live.clear()
        self._fiber = None

    def wrap(self, step: MetaStep, run: Callable[[], Any]) -> Callable[[], Any]:
        """The body of compute leaf ``step`` as the batch runs it (module docstring);
        ``run`` itself for a stage without MoE blocks."""
        if step.stage not in self._blocks:
            return run
        if not self._fibers[step.stage]:
            return _Stepped(self, step, run)
        return _FiberBody(self, step, run)

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
