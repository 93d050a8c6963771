"""The time model of the cost-aware swap policy: :class:`CostModel` and :func:`simulate_run`.

A deterministic, event-by-event simulation of one training step of every rank's finalized
order (with or without swap steps), in seconds, from a few measured numbers. The policy in
``ppswap.scheduler.cost`` uses it to predict the exposed copy wait of a chunk selection.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

from ppswap.scheduler.analysis import check_orders, compute_slots, slot_dependencies
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_calibration import StageBytes, calibrated_fields
from ppswap.scheduler.steps import (
    RECOMPUTE,
    SWAP_LAUNCH_KINDS,
    SWAP_WAIT_KINDS,
    Order,
    StepKind,
)

__all__ = [
    "DEFAULT_COST_BUDGET",
    "CostModel",
    "Program",
    "RunEstimate",
    "Simulator",
    "StageBytes",
    "simulate_run",
]

DEFAULT_COST_BUDGET = 0.02
"""The default exposed-wait budget: 2% of the step time, per rank."""


def _check_number(name: str, value: Any, *, allow_inf: bool, allow_zero: bool) -> float:
    allowed = (
        f"a number {'>= 0' if allow_zero else '> 0'}"
        f"{' (math.inf allowed)' if allow_inf else ', finite'}"
    )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
    number = float(value)
    if (
        math.isnan(number)
        or number < 0
        or (number == 0 and not allow_zero)
        or (math.isinf(number) and not allow_inf)
    ):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return number


def _check_chunk_bytes(value: Any) -> None:
    allowed = "an int >= 0 or a non-empty tuple of ints >= 0 (one per global stage)"
    items = value if isinstance(value, tuple) else (value,)
    if isinstance(value, tuple) and not value:
        raise ValueError(f"chunk_bytes must be {allowed}, got {value!r}")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(f"chunk_bytes must be {allowed}, got {value!r}")
        if item < 0:
            raise ValueError(f"chunk_bytes must be {allowed}, got {value!r}")


@dataclass(frozen=True, slots=True)
class CostModel:
    """What the cost policy knows about copies and compute.

    ``chunk_bytes``: bytes one chunk moves each way, one int for every stage or a tuple
    indexed by global stage. ``d2h_gbps`` / ``h2d_gbps``: copy bandwidth in GB/s (1e9
    bytes/s, as ``EmulatedDevice``); ``math.inf`` is a free copy, ``0`` a copy that never
    ends. ``leaf_s``: wall time of one compute leaf (a FWD, and any leaf when
    ``backward_leaf_s`` is None). ``backward_leaf_s``: wall time of one BWD leaf; a split
    backward's BWD_INPUT and BWD_WEIGHT take half of it each (a backward usually costs more
    than a forward, up to twice as much, and the loads land in the backward phase, where
    that difference decides whether a copy hides). ``headroom``: the share of the budget the
    policy lets the *predicted* exposed wait use, in ``[0, 1]``; below 1 it keeps the rest
    for the model's error (on a shared machine the measured wait of one plan varies by a few
    points of the step from run to run). ``p2p_latency_s``: from a leaf's end to the start
    of the leaf on another rank that needs its result (the activation or gradient must
    travel); it decides who comes first at the shared compute thread, where a rank that
    needs nothing from another rank otherwise ties with one that does. ``budget``: the
    exposed wait allowed per rank, a share of the step time in ``[0, 1]`` (0.02 = 2%).
    ``copy_overhead_s``: a fixed cost per copy on top of ``bytes / bandwidth``.
    ``shared_compute``: all ranks share one compute thread (the in-process runtime); False
    is one device per rank. ``swap_step_s``: with ``shared_compute``, the compute-thread
    time of each swap step's own job (preparing a copy, finishing one); 0 still queues the
    job behind the compute already requested, which is what delays a copy's start there.
    ``split_directions``: offloads and loads run on separate copy streams (the runtime's
    default, ``CopyStream(split_directions=True)``); False is one stream for both.

    Measure them on the target: ``leaf_s`` and ``backward_leaf_s`` from a swap run's
    ``RankStats.compute_job_s`` / ``compute_jobs`` (``"forward"``, ``"backward"``), or
    ``leaf_s`` alone as its step time divided by its compute leaves; ``swap_step_s`` from
    the same run's ``"swap_prepare"`` / ``"swap_finish"`` jobs; ``chunk_bytes`` as
    ``RankStats.offloaded_bytes`` per offloaded chunk; ``copy_overhead_s`` as the
    ``copy_busy_s / copies`` of a run at the target bandwidth minus ``bytes / bandwidth``.

    For a memory budget (``ppswap.scheduler.budget``): ``stage_bytes``, one
    :class:`StageBytes` per global stage (the bytes a chunk keeps, moves, holds recomputed
    and regenerates), and ``recompute_leaf_s``, the compute time of one RECOMPUTE step
    (None: ``leaf_s``, a forward's). :meth:`from_result` measures all of them from earlier
    steps of the same stages.
    """

    chunk_bytes: int | tuple[int, ...]
    d2h_gbps: float
    h2d_gbps: float
    leaf_s: float
    budget: float = DEFAULT_COST_BUDGET
    copy_overhead_s: float = 0.0
    shared_compute: bool = False
    swap_step_s: float = 0.0
    backward_leaf_s: float | None = None
    headroom: float = 1.0
    p2p_latency_s: float = 0.0
    stage_bytes: tuple[StageBytes, ...] | None = None
    recompute_leaf_s: float | None = None
    split_directions: bool = True

    @classmethod
    def from_result(
        cls,
        result: Any,
        *more: Any,
        copy_gbps: float | None = None,
        shared_compute: bool = True,
        **changes: Any,
    ) -> CostModel:
        """A model measured from ``result`` (and ``more`` results of the same stages):
        chunk bytes per stage and policy, compute times per leaf, the copy bandwidth
        (``ppswap.scheduler.cost_calibration`` says which figure comes from where).
        ``copy_gbps``: plan with this bandwidth instead of the measured one;
        ``shared_compute``: the ranks share one compute thread (the in-process runtime);
        ``changes``: any other field (``budget``, ``headroom`` ...)."""
        results = (result, *more)
        stages = [chunk[0] for r in results for rank in r.ranks for chunk in rank.chunk_bytes]
        fields = calibrated_fields(
            results,
            num_stages=max(stages, default=-1) + 1,
            copy_gbps=copy_gbps,
            shared_compute=shared_compute,
        )
        fields.update(changes)
        return cls(**fields)

    def __post_init__(self) -> None:
        _check_chunk_bytes(self.chunk_bytes)
        _check_number("d2h_gbps", self.d2h_gbps, allow_inf=True, allow_zero=True)
        _check_number("h2d_gbps", self.h2d_gbps, allow_inf=True, allow_zero=True)
        _check_number("leaf_s", self.leaf_s, allow_inf=False, allow_zero=False)
        budget = _check_number("budget", self.budget, allow_inf=False, allow_zero=True)
        if budget > 1:
            raise ValueError(
                f"budget must be a share of the step time in [0, 1] (0.02 = 2%), got "
                f"{self.budget!r}"
            )
        _check_number("copy_overhead_s", self.copy_overhead_s, allow_inf=False, allow_zero=True)
        if not isinstance(self.shared_compute, bool):
            raise TypeError(f"shared_compute must be a bool, got {self.shared_compute!r}")
        if not isinstance(self.split_directions, bool):
            raise TypeError(f"split_directions must be a bool, got {self.split_directions!r}")
        _check_number("swap_step_s", self.swap_step_s, allow_inf=False, allow_zero=True)
        headroom = _check_number("headroom", self.headroom, allow_inf=False, allow_zero=True)
        if headroom > 1:
            raise ValueError(f"headroom must be a share in [0, 1], got {self.headroom!r}")
        _check_number("p2p_latency_s", self.p2p_latency_s, allow_inf=False, allow_zero=True)
        if self.backward_leaf_s is not None:
            _check_number(
                "backward_leaf_s", self.backward_leaf_s, allow_inf=False, allow_zero=False
            )
        if self.recompute_leaf_s is not None:
            _check_number(
                "recompute_leaf_s", self.recompute_leaf_s, allow_inf=False, allow_zero=True
            )
        if self.stage_bytes is not None and not (
            isinstance(self.stage_bytes, tuple)
            and all(isinstance(item, StageBytes) for item in self.stage_bytes)
        ):
            raise TypeError(
                f"stage_bytes must be a tuple of StageBytes (one per global stage) or None, "
                f"got {self.stage_bytes!r}"
            )

    @property
    def recompute_s(self) -> float:
        """Compute time of one RECOMPUTE step."""
        return self.leaf_s if self.recompute_leaf_s is None else self.recompute_leaf_s

    def leaf_time(self, kind: StepKind) -> float:
        """Compute time of one leaf of ``kind`` (FWD, BWD, BWD_INPUT or BWD_WEIGHT)."""
        if self.backward_leaf_s is None or kind is StepKind.FWD:
            return self.leaf_s
        if kind is StepKind.BWD:
            return self.backward_leaf_s
        return self.backward_leaf_s / 2

    def bytes_of(self, stage: int) -> int:
        """Bytes one chunk of global stage ``stage`` moves in each direction."""
        if isinstance(self.chunk_bytes, int):
            return self.chunk_bytes
        return self.chunk_bytes[stage]

    def copy_s(self, kind: StepKind, stage: int) -> float:
        """Copy-stream time of one chunk's offload (LAUNCH_OFFLOAD) or load (LAUNCH_LOAD)."""
        gbps = self.d2h_gbps if kind is StepKind.SWAP_LAUNCH_OFFLOAD else self.h2d_gbps
        nbytes = self.bytes_of(stage)
        if nbytes == 0 or math.isinf(gbps):
            return self.copy_overhead_s
        if gbps == 0:
            return math.inf
        return self.copy_overhead_s + nbytes / (gbps * 1e9)

    def check_for(self, config: ScheduleConfig) -> None:
        """ValueError when ``chunk_bytes`` is a tuple of the wrong length for ``config``."""
        if isinstance(self.chunk_bytes, tuple) and len(self.chunk_bytes) != config.num_stages:
            raise ValueError(
                f"cost.chunk_bytes must hold one entry per global stage ({config.num_stages} "
                f"for pp={config.pp}, vpp={config.vpp}), got {len(self.chunk_bytes)}"
            )
        if self.stage_bytes is not None and len(self.stage_bytes) != config.num_stages:
            raise ValueError(
                f"cost.stage_bytes must hold one entry per global stage ({config.num_stages} "
                f"for pp={config.pp}, vpp={config.vpp}), got {len(self.stage_bytes)}"
            )


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
