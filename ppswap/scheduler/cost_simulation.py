"""The simulated step: :func:`simulate_run` and :class:`Simulator`, from a
:class:`~ppswap.scheduler.cost_model.CostModel`.

A deterministic, event-by-event simulation of one training step of every rank's finalized
order (with or without swap steps), in seconds. The policy in ``ppswap.scheduler.cost``
uses it to predict the exposed copy wait of a chunk selection; the memory budget
(``ppswap.scheduler.budget``) to compare plans.

The simulation
    Each rank walks its order. A compute slot (a leaf, or a composite holding two) is
    requested when the rank has reached it and every leaf it depends on has finished (the
    dependency rule of ``ppswap.scheduler.analysis``: FWD after the previous stage's FWD;
    BWD / BWD_INPUT after the next stage's backward consumer, or after its own FWD on the
    last stage; BWD_WEIGHT after its BWD_INPUT). It runs for the ``CostModel.leaf_time``
    of each of its leaves on the rank's own device, or, with ``shared_compute``, on the one
    compute thread every rank shares, which serves requests first come, first served
    (ties: lower rank): the in-process runtime. A leaf that needs another rank's result
    starts ``p2p_latency_s`` after it at the earliest; P2P and FSDP steps take no time.
    SWAP_LAUNCH_* queues a copy of ``copy_s(kind, stage)`` on the rank's FIFO stream of its
    direction, as the runtime's ``CopyStream`` runs offloads and loads on two threads (a
    load never queues behind an offload; ``split_directions=False``: one FIFO for both);
    it starts when the stream is free, not before the launch. SWAP_WAIT_* blocks the rank
    until its copy is done: that block is the *exposed* wait, as
    ``RankStats.exposed_copy_wait_s`` measures it.
    With ``shared_compute`` each swap step also runs a job on the shared thread, as the
    runtime does (``prepare_*`` before the copy starts, ``finish_*`` after the wait): it
    takes ``swap_step_s`` and, like the runtime's urgent lane, runs as soon as the thread
    is free, ahead of the compute slots requested before it. A
    stall delays the rank's next requests and, through the dependencies and the shared
    thread, the other ranks: exactly what happens at run time, to the precision of the
    inputs. What it leaves out: copies competing with compute for CPU, and the event
    loop's latency other than a transfer's (``p2p_latency_s``); which of two nearly
    simultaneous requests of different ranks reaches the shared thread first turns on
    that latency, and the model picks one order.

Nothing here imports MindSpore or anyio; every function is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from ppswap.scheduler.analysis import check_orders, compute_slots, slot_dependencies
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel
from ppswap.scheduler.steps import (
    RECOMPUTE,
    SWAP_LAUNCH_KINDS,
    SWAP_WAIT_KINDS,
    Order,
    StepKind,
)

__all__ = ["Program", "RunEstimate", "Simulator", "simulate_run"]


@dataclass(frozen=True, slots=True)
class RunEstimate:
    """The simulated step (seconds): per rank the (start, end) of every compute slot in
    order, the exposed copy wait and the copy stream's busy time; the step's end."""

    slot_times: tuple[tuple[tuple[float, float], ...], ...]
    exposed_s: tuple[float, ...]
    copy_busy_s: tuple[float, ...]
    step_s: float


_COMPUTE, _LAUNCH, _WAIT, _RECOMPUTE = 0, 1, 2, 3
_Op = tuple[int, int | tuple[bool, int, int], float]
"""A step of a rank's program: (COMPUTE, slot id, 0), (LAUNCH, copy key, seconds),
(WAIT, copy key, 0) or (RECOMPUTE, 0, seconds: compute time with no dependency of its own);
P2P and FSDP steps are left out (they take no time)."""
Program = tuple[_Op, ...]
"""A rank's order as the simulator runs it (``Simulator.program``)."""


class Simulator:
    """The part of a simulation that does not depend on the swap steps: every compute slot
    of every rank (numbered globally), the slots each one waits for, its leaves. Build it
    once per schedule, then :meth:`run` the orders of as many swap selections as needed
    (their compute slots must be those it was built from)."""

    def __init__(self, config: ScheduleConfig, orders: Sequence[Order], cost: CostModel) -> None:
        check_orders(config, orders)
        if not isinstance(cost, CostModel):
            raise TypeError(f"cost must be a CostModel, got {type(cost).__name__}")
        cost.check_for(config)
        self.config = config
        self.cost = cost
        slots = [compute_slots(order) for order in orders]
        self.slot_ids: list[list[int]] = []
        self.slot_s: list[float] = []  # compute time of every slot, by slot id
        for rank_slots in slots:
            first = len(self.slot_s)
            self.slot_ids.append(list(range(first, first + len(rank_slots))))
            self.slot_s.extend(
                sum(cost.leaf_time(leaf.kind) for leaf in slot.leaves) for slot in rank_slots
            )
        latency = cost.p2p_latency_s
        # per slot: (slot it waits for, delay after that slot ends: p2p_latency_s when the
        # result comes from another rank)
        self.deps: list[tuple[tuple[int, float], ...]] = [
            tuple(
                (self.slot_ids[other][slot], 0.0 if other == rank else latency)
                for other, slot in needed
            )
            for rank, rank_deps in enumerate(slot_dependencies(config, slots))
            for needed in rank_deps
        ]

    def program(self, rank: int, order: Order) -> Program:
        """Rank ``rank``'s ``order`` (with its swap steps) as the simulator runs it."""
        ids = iter(self.slot_ids[rank])
        ops: list[_Op] = []
        for step in order:
            if step.is_compute:
                slot_id = next(ids, None)
                if slot_id is None:
                    raise ValueError(f"the order of rank {rank} has more compute slots than built")
                ops.append((_COMPUTE, slot_id, 0.0))
            elif step.kind in SWAP_LAUNCH_KINDS:
                key = (step.kind is StepKind.SWAP_LAUNCH_LOAD, step.stage, step.micro)
                ops.append((_LAUNCH, key, self.cost.copy_s(step.kind, step.stage)))
            elif step.kind in SWAP_WAIT_KINDS:
                key = (step.kind is StepKind.SWAP_WAIT_LOAD, step.stage, step.micro)
                ops.append((_WAIT, key, 0.0))
            elif step.kind is RECOMPUTE:
                ops.append((_RECOMPUTE, 0, self.cost.recompute_s))
        if next(ids, None) is not None:
            raise ValueError(f"the order of rank {rank} has fewer compute slots than built")
        return tuple(ops)

    def run(self, programs: Sequence[Sequence[_Op]]) -> RunEstimate:
        """Simulate one step of every rank's program (see the module docstring).

        Each rank's next request is served in order of the time it can start: the earliest
        first (ties: the lower rank); with ``shared_compute``, a swap job that can start by
        the time the thread is free goes ahead of a compute slot (the urgent lane). A
        rank's start time is computed when its request or one of its inputs changes, not
        at every event.
        """
        state = _RunState(self, programs)
        ready_at = state.ready_at
        request = state.request
        shared = state.shared
        ranks = range(self.config.pp)
        while True:
            chosen = -1
            chosen_ready = 0.0
            for rank in ranks:
                ready = ready_at[rank]
                if ready is not None and (chosen < 0 or ready < chosen_ready):
                    chosen, chosen_ready = rank, ready
            if chosen >= 0 and shared and request[chosen] != _JOB:
                # the urgent lane: a swap job requested by the time the thread takes its
                # next request goes first (the earliest; ties: the lower rank)
                free_at = max(chosen_ready, state.shared_free)
                job = -1
                job_ready = 0.0
                for rank in ranks:
                    ready = ready_at[rank]
                    if (
                        ready is not None
                        and request[rank] == _JOB
                        and ready <= free_at
                        and (job < 0 or ready < job_ready)
                    ):
                        job, job_ready = rank, ready
                if job >= 0:
                    chosen, chosen_ready = job, job_ready
            if chosen < 0:
                stuck = [rank for rank in ranks if request[rank] != _DONE]
                if not stuck:
                    break
                raise ValueError(f"the orders of ranks {stuck} wait on each other: no rank can run")
            state.serve(chosen, chosen_ready)
        return RunEstimate(
            slot_times=tuple(tuple(rank) for rank in state.times),
            exposed_s=tuple(state.exposed),
            copy_busy_s=tuple(state.busy),
            step_s=max(state.now, default=0.0),
        )


_DONE, _SLOT, _JOB = -1, 0, 1  # what a rank asks for next: nothing, its compute slot, a job


class _RunState:
    """The mutable state of one ``Simulator.run``: per rank its position in its program,
    clock, copy stream, pending request and when that request can start (None: nothing
    to run, or an input is missing; the rank is then listed under that input's slot in
    ``blocked``); the shared compute thread's clock."""

    def __init__(self, simulator: Simulator, programs: Sequence[Sequence[_Op]]) -> None:
        pp = simulator.config.pp
        self.sim = simulator
        self.deps = simulator.deps
        self.slot_s = simulator.slot_s
        self.swap_step_s = simulator.cost.swap_step_s
        self.programs = programs
        self.shared = simulator.cost.shared_compute
        self.finished = [-1.0] * len(simulator.slot_s)
        self.times: list[list[tuple[float, float]]] = [[] for _ in range(pp)]
        self.now = [0.0] * pp
        # per rank: when its offload [0] and load [1] streams are free ([0] alone unsplit)
        self.stream = [[0.0, 0.0] for _ in range(pp)]
        self.split = simulator.cost.split_directions
        self.exposed = [0.0] * pp
        self.busy = [0.0] * pp
        self.copies: list[dict[object, float]] = [{} for _ in range(pp)]
        self.index = [0] * pp
        self.request = [_DONE] * pp
        self.ready_at: list[float | None] = [None] * pp
        self.blocked: dict[int, list[int]] = {}  # slot id -> ranks waiting for it to finish
        self.job_done = [False] * pp  # the current step's compute-thread job has run
        self.job_s = [0.0] * pp  # how long the requested job takes
        self.waited = [False] * pp  # the current SWAP_WAIT's copy has been waited for
        self.shared_free = 0.0
        for rank in range(pp):
            self.advance(rank)
            self.ready_at[rank] = self.ready(rank)

    def ready(self, rank: int) -> float | None:
        """When rank ``rank``'s request can start (None: nothing to run, or inputs missing:
        then the rank waits in ``blocked`` for the first missing input)."""
        kind = self.request[rank]
        if kind == _DONE:
            return None
        ready = self.now[rank]
        if kind == _JOB:
            return ready
        # A compute request: its op's second field is a slot id.
        slot_id = cast(int, self.programs[rank][self.index[rank]][1])
        finished = self.finished
        for dep, delay in self.deps[slot_id]:
            done = finished[dep]
            if done < 0:
                self.blocked.setdefault(dep, []).append(rank)
                return None
            if done + delay > ready:
                ready = done + delay
        return ready

    def serve(self, rank: int, ready: float) -> None:
        """Run rank ``rank``'s request (on its device or the shared thread), then advance."""
        start = max(ready, self.shared_free) if self.shared else ready
        if self.request[rank] == _JOB:
            end = start + self.job_s[rank]
            self.job_done[rank] = True
        else:
            slot_id = cast(int, self.programs[rank][self.index[rank]][1])
            end = start + self.slot_s[slot_id]
            self.finished[slot_id] = end
            self.times[rank].append((start, end))
            self.index[rank] += 1
            for waiter in self.blocked.pop(slot_id, ()):
                self.ready_at[waiter] = self.ready(waiter)
        if self.shared:
            self.shared_free = end
        self.now[rank] = end
        self.advance(rank)
        self.ready_at[rank] = self.ready(rank)

    def advance(self, rank: int) -> None:
        """Run rank ``rank``'s program up to its next request: a compute slot, or (shared
        compute thread only) the job before a copy starts or after a copy was waited for."""
        program = self.programs[rank]
        position = self.index[rank]
        while position < len(program):
            op, key, duration = program[position]
            if op == _COMPUTE:
                self.index[rank], self.request[rank] = position, _SLOT
                return
            if op == _WAIT and not self.waited[rank]:
                done = self.copies[rank].pop(key, None)
                if done is None:
                    raise ValueError(f"rank {rank}: a swap wait has no launch before it ({key})")
                if done > self.now[rank]:
                    self.exposed[rank] += done - self.now[rank]
                    self.now[rank] = done
                self.waited[rank] = True
            if op == _RECOMPUTE and not self.shared:
                self.now[rank] += duration
            elif self.shared and not self.job_done[rank]:
                self.index[rank], self.request[rank] = position, _JOB
                self.job_s[rank] = duration if op == _RECOMPUTE else self.swap_step_s
                return
            if op == _LAUNCH:
                lanes = self.stream[rank]
                lane = 1 if self.split and cast(tuple[bool, int, int], key)[0] else 0
                lanes[lane] = max(self.now[rank], lanes[lane]) + duration
                self.busy[rank] += duration
                self.copies[rank][key] = lanes[lane]
            self.job_done[rank] = self.waited[rank] = False
            position += 1
        self.index[rank], self.request[rank] = position, _DONE


def simulate_run(config: ScheduleConfig, orders: Sequence[Order], cost: CostModel) -> RunEstimate:
    """Simulate one step of ``orders`` (one per rank, swap steps optional) under ``cost``.

    See the module docstring. Raises ValueError when a slot waits for a leaf no rank runs,
    a wait has no launch, or the ranks wait on each other in a cycle.
    """
    simulator = Simulator(config, orders, cost)
    return simulator.run([simulator.program(rank, order) for rank, order in enumerate(orders)])
