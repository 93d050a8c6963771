"""The cost-aware swap policy, ``swap_policy="cost"`` (RFC section 3.2 follow-up 4).

The fixed rule (``swap_policy="gap"``, the default) swaps every chunk whose gap is at least
``min_swap_gap`` and ignores how long a copy takes. On a slow link the copies queue on the
rank's single copy stream and SWAP_WAIT_* blocks compute: the *exposed* copy wait. This
policy picks, per rank, a subset of the fixed rule's chunks so that the *predicted* exposed
wait stays within a budget (default 2% of the step time) while the predicted peak of
resident chunks (the memory model of ``ppswap.scheduler.simulate``) is as low as it can be.
The selected chunks are placed by the fixed rule's anchors (``swap_plan.inject_swap_steps``
with ``chunks=``), so the two policies differ only in *which* chunks move.

Inputs: :class:`CostModel`
    ``chunk_bytes`` (bytes one chunk moves each way: one int for every stage, or one per
    global stage), ``d2h_gbps`` / ``h2d_gbps`` (copy bandwidth in GB/s as in
    ``EmulatedDevice``; ``math.inf`` means free copies, ``0`` infinitely slow ones),
    ``leaf_s`` (wall time of one compute leaf: FWD, BWD, ...), ``copy_overhead_s`` (fixed
    cost per copy), ``budget`` (the allowed exposed wait per rank, as a share of the step
    time) and ``shared_compute`` (all ranks run their compute on one thread, as in the
    in-process runtime: see below). Measure them on the target: ``leaf_s`` as the no-swap
    step time divided by the number of compute leaves, ``chunk_bytes`` as
    ``RankStats.offloaded_bytes`` per offloaded chunk, ``copy_overhead_s`` as
    ``RankStats.copy_busy_s / RankStats.copies`` of an unthrottled swap run.

Time model (per rank, deterministic)
    The compute slots keep the columns of the global logical timeline
    (``simulate.build_timeline`` of the orders without swap). A column lasts
    ``leaf_s * n`` where ``n`` is the largest number of compute leaves any rank runs in it
    (a composite holds two), or, with ``shared_compute``, the number of leaves all ranks
    run in it together (one compute thread serves every rank in turn). Walking the rank's
    order with the swap steps of a selection: a compute slot starts at
    ``max(now, column start)`` and lasts its column (so a stall is absorbed by a later
    bubble); P2P and FSDP steps take no time; a SWAP_LAUNCH_* queues a copy of
    ``copy_overhead_s + bytes / bandwidth`` on the FIFO copy stream (it starts when the
    stream is free and not before the launch); a SWAP_WAIT_* blocks until its copy is done
    and that block is the exposed wait, as ``RankStats.exposed_copy_wait_s`` measures it.
    The step time is the end of the last column; the budget of each rank is
    ``budget * step time``. Ranks are planned independently (a stall on one rank is not
    propagated to the others): the budget bounds each rank's own exposed wait.

Selection (per rank; candidates are the fixed rule's chunks)
    1. If the fixed rule's whole set fits the budget, take it: with free or fast copies the
       policy is the fixed rule, chunk for chunk.
    2. Otherwise a greedy on memory benefit, starting from no chunk: each round evaluates
       every remaining candidate added to the selection, drops for good those that break
       the budget (the copy stream is FIFO and every time in the walk is a max/plus of
       non-negative terms, so adding copies never shortens a wait: a chunk that does not
       fit now never fits later), and adds the one that lowers the predicted profile the
       most: the lowest peak, then the fewest steps at that peak, then the least exposed
       wait, then the longest gap, then the earliest FWD. It stops when no candidate
       lowers (peak, steps at peak): no remaining chunk is off device at a peak step, so
       more copies would only spend bandwidth.
    3. Pruning, newest first: a chosen chunk whose removal leaves the peak where it is is
       dropped (it only lowered the number of peak steps on a plateau that another step
       keeps up), so the policy moves no bytes that do not lower the peak.
    Why a greedy suffices: a swapped chunk lowers the profile by one exactly over its
    off-device window, so the peak drops only when every peak step is covered; the greedy
    covers peak steps one at a time with the cheapest chunk that does, and the budget
    check is exact for the model. Chunks with gap 2 or 3 are never candidates: with these
    anchors their load is launched where their offload is waited, so they free nothing.

Nothing here imports MindSpore or anyio; every function is pure. The policy is not a step
of ``lowering.build_exec_order`` because the memory model (``simulate``) imports lowering:
callers with a policy use :func:`build_orders` (the runtime does).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.simulate import Timeline, build_timeline, memory_profile
from ppswap.scheduler.steps import Order, StepKind
from ppswap.scheduler.swap_plan import compute_slots, inject_swap_steps, plan_swap

__all__ = [
    "DEFAULT_COST_BUDGET",
    "SWAP_POLICIES",
    "CopyEstimate",
    "CostModel",
    "CostPlan",
    "RankCostPlan",
    "SwapPolicy",
    "build_cost_aware_orders",
    "build_orders",
    "check_swap_policy",
    "column_starts",
    "estimate_copies",
    "plan_cost_aware",
]

SwapPolicy = Literal["gap", "cost"]
SWAP_POLICIES: tuple[str, ...] = get_args(SwapPolicy)
DEFAULT_COST_BUDGET = 0.02

_LAUNCH_KINDS = frozenset({StepKind.SWAP_LAUNCH_OFFLOAD, StepKind.SWAP_LAUNCH_LOAD})
_LAUNCH_OF_WAIT = {
    StepKind.SWAP_WAIT_OFFLOAD: StepKind.SWAP_LAUNCH_OFFLOAD,
    StepKind.SWAP_WAIT_LOAD: StepKind.SWAP_LAUNCH_LOAD,
}
_TOLERANCE_S = 1e-12
Chunk = tuple[int, int]


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
    """What the cost policy knows about copies and compute (see the module docstring).

    Bandwidths in GB/s (1e9 bytes/s): ``math.inf`` is a free copy, ``0`` a copy that never
    ends. ``budget`` is a share of the step time in ``[0, 1]`` (0.02 = 2%).
    """

    chunk_bytes: int | tuple[int, ...]
    d2h_gbps: float
    h2d_gbps: float
    leaf_s: float
    budget: float = DEFAULT_COST_BUDGET
    copy_overhead_s: float = 0.0
    shared_compute: bool = False

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


def check_swap_policy(swap_policy: object, cost_model: object) -> None:
    """Refuse a bad ``swap_policy`` / ``cost_model`` pair (TypeError or ValueError).

    ``"gap"`` takes no cost model; ``"cost"`` needs a :class:`CostModel`. The policy only
    matters when swap is on: with ``swap=False`` nothing is swapped either way.
    """
    if swap_policy not in SWAP_POLICIES:
        raise ValueError(
            f"swap_policy must be one of {', '.join(SWAP_POLICIES)}, got {swap_policy!r}"
        )
    if swap_policy == "cost" and not isinstance(cost_model, CostModel):
        raise TypeError(
            "swap_policy='cost' needs cost_model=CostModel(...) (chunk bytes, copy "
            f"bandwidths, compute time per leaf), got {cost_model!r}"
        )
    if swap_policy == "gap" and cost_model is not None:
        raise ValueError(
            "cost_model is only used with swap_policy='cost'; got swap_policy='gap' and "
            f"cost_model={cost_model!r}"
        )


def _check_inputs(config: object, cost: object) -> tuple[ScheduleConfig, CostModel]:
    if not isinstance(config, ScheduleConfig):
        raise TypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost must be a CostModel, got {type(cost).__name__}")
    if isinstance(cost.chunk_bytes, tuple) and len(cost.chunk_bytes) != config.num_stages:
        raise ValueError(
            f"cost.chunk_bytes must hold one entry per global stage ({config.num_stages} for "
            f"pp={config.pp}, vpp={config.vpp}), got {len(cost.chunk_bytes)}"
        )
    if config.forward_only:
        raise ValueError("the cost policy needs a backward: config.forward_only must be False")
    return config, cost


def column_starts(timeline: Timeline, cost: CostModel) -> tuple[float, ...]:
    """Start time of every column of ``timeline`` plus the end of the last one (seconds).

    A column lasts ``cost.leaf_s`` times the most compute leaves one rank runs in it, or,
    with ``cost.shared_compute``, the leaves all ranks run in it together.
    """
    leaves = [[0] * timeline.num_columns for _ in timeline.cells]
    for rank, cells in enumerate(timeline.cells):
        for cell in cells:
            leaves[rank][cell.column] = len(cell.step.sub_steps) or 1
    starts = [0.0]
    for column in range(timeline.num_columns):
        in_column = [rank_leaves[column] for rank_leaves in leaves]
        count = sum(in_column) if cost.shared_compute else max(in_column, default=0)
        starts.append(starts[-1] + count * cost.leaf_s)
    return tuple(starts)


@dataclass(frozen=True, slots=True)
class CopyEstimate:
    """Predicted copy behaviour of one rank's order with swap steps (seconds)."""

    exposed_s: float
    copy_busy_s: float
    end_s: float


def estimate_copies(
    order: Order, rank: int, timeline: Timeline, starts: Sequence[float], cost: CostModel
) -> CopyEstimate:
    """Walk rank ``rank``'s ``order`` (with its swap steps) through the time model.

    ``timeline`` is the global timeline of the orders (with or without swap steps: the
    compute slots are the same), ``starts`` its ``column_starts``. Returns the exposed
    wait, the copy stream's busy time and when the rank's last step ends.
    """
    cells = timeline.cells[rank]
    slots = compute_slots(order)
    if len(slots) != len(cells):
        raise ValueError(
            f"order does not match the timeline of rank {rank}: {len(slots)} compute slots "
            f"against {len(cells)}"
        )
    slot_at = {slot.index: cells[slot.slot].column for slot in slots}
    now = 0.0
    stream_free = 0.0
    exposed = 0.0
    busy = 0.0
    done: dict[tuple[StepKind, Chunk], float] = {}
    for index, step in enumerate(order):
        column = slot_at.get(index)
        if column is not None:
            now = max(now, starts[column]) + (starts[column + 1] - starts[column])
        elif step.kind in _LAUNCH_KINDS:
            duration = cost.copy_s(step.kind, step.stage)
            stream_free = max(now, stream_free) + duration
            busy += duration
            done[(step.kind, step.chunk)] = stream_free
        elif step.kind in _LAUNCH_OF_WAIT:
            finished = done.pop((_LAUNCH_OF_WAIT[step.kind], step.chunk), None)
            if finished is None:
                raise ValueError(f"{step.short()} of rank {rank} has no launch before it")
            if finished > now:
                exposed += finished - now
                now = finished
    return CopyEstimate(exposed_s=exposed, copy_busy_s=busy, end_s=now)


@dataclass(frozen=True, slots=True)
class RankCostPlan:
    """The cost policy's choice for one rank, with the fixed rule's figures beside it.

    ``candidates`` are the fixed rule's chunks, ``chunks`` the selected ones. Peaks are in
    resident chunks (``simulate.memory_profile``), times in seconds of the time model.
    """

    rank: int
    chunks: frozenset[Chunk]
    candidates: frozenset[Chunk]
    peak_chunks: int
    peak_chunks_gap: int
    peak_chunks_no_swap: int
    exposed_s: float
    exposed_s_gap: float
    copy_busy_s: float
    budget_s: float

    @property
    def within_budget(self) -> bool:
        return self.exposed_s <= self.budget_s + _TOLERANCE_S


@dataclass(frozen=True, slots=True)
class CostPlan:
    """Per rank choices of the cost policy; ``step_s`` is the predicted no-swap step time."""

    ranks: tuple[RankCostPlan, ...]
    step_s: float

    @property
    def chunks(self) -> frozenset[Chunk]:
        """Every selected chunk of every rank (the ``chunks=`` of ``inject_swap_steps``)."""
        return frozenset(chunk for rank in self.ranks for chunk in rank.chunks)


@dataclass(frozen=True, slots=True)
class _Evaluation:
    chunks: frozenset[Chunk]
    peak: int
    at_peak: int
    copies: CopyEstimate


class _RankPlanner:
    """Evaluates selections of one rank (a helper of ``plan_cost_aware``)."""

    def __init__(
        self,
        config: ScheduleConfig,
        rank: int,
        order: Order,
        timeline: Timeline,
        starts: Sequence[float],
        cost: CostModel,
    ) -> None:
        self.config = config
        self.rank = rank
        self.order = order
        self.timeline = timeline
        self.starts = starts
        self.cost = cost

    def evaluate(self, chunks: frozenset[Chunk]) -> _Evaluation:
        swapped = inject_swap_steps(self.order, self.config, self.rank, chunks=chunks)
        profile = memory_profile(swapped)
        peak = max(profile, default=0)
        copies = estimate_copies(swapped, self.rank, self.timeline, self.starts, self.cost)
        return _Evaluation(chunks, peak, profile.count(peak), copies)


def _select(
    planner: _RankPlanner,
    candidates: Sequence[tuple[Chunk, int, int]],
    full: _Evaluation,
    budget_s: float,
) -> _Evaluation:
    """The selection rule of the module docstring; candidates are (chunk, gap, fwd_slot)."""
    if full.copies.exposed_s <= budget_s + _TOLERANCE_S:
        return full
    current = planner.evaluate(frozenset())
    remaining = list(candidates)
    added: list[Chunk] = []
    while remaining:
        best: tuple[tuple[float, ...], _Evaluation, tuple[Chunk, int, int]] | None = None
        fitting: list[tuple[Chunk, int, int]] = []
        for candidate in remaining:
            chunk, gap, fwd_slot = candidate
            trial = planner.evaluate(current.chunks | {chunk})
            if trial.copies.exposed_s > budget_s + _TOLERANCE_S:
                continue
            fitting.append(candidate)
            key = (trial.peak, trial.at_peak, trial.copies.exposed_s, -gap, fwd_slot)
            if best is None or key < best[0]:
                best = (key, trial, candidate)
        if best is None:
            break
        _, trial, chosen = best
        if (trial.peak, trial.at_peak) >= (current.peak, current.at_peak):
            break
        current = trial
        added.append(chosen[0])
        remaining = [candidate for candidate in fitting if candidate != chosen]
    for chunk in reversed(added):
        trial = planner.evaluate(current.chunks - {chunk})
        if trial.peak <= current.peak:
            current = trial
    return current


def plan_cost_aware(config: ScheduleConfig, cost: CostModel) -> CostPlan:
    """Choose every rank's chunks under ``cost`` (module docstring); ``config.swap`` is
    treated as True. Raises TypeError/ValueError for bad inputs."""
    config, cost = _check_inputs(config, cost)
    plain = build_all_orders(replace(config, swap=False))
    swap_config = replace(config, swap=True)
    timeline = build_timeline(config, plain)
    starts = column_starts(timeline, cost)
    step_s = starts[-1]
    budget_s = cost.budget * step_s
    ranks: list[RankCostPlan] = []
    for rank, order in enumerate(plain):
        planner = _RankPlanner(swap_config, rank, order, timeline, starts, cost)
        eligible = [plan for plan in plan_swap(order, swap_config) if plan.eligible]
        candidates = [(plan.chunk, plan.gap, plan.fwd_slot) for plan in eligible]
        full = planner.evaluate(frozenset(plan.chunk for plan in eligible))
        chosen = _select(planner, candidates, full, budget_s)
        ranks.append(
            RankCostPlan(
                rank=rank,
                chunks=chosen.chunks,
                candidates=full.chunks,
                peak_chunks=chosen.peak,
                peak_chunks_gap=full.peak,
                peak_chunks_no_swap=max(memory_profile(order), default=0),
                exposed_s=chosen.copies.exposed_s,
                exposed_s_gap=full.copies.exposed_s,
                copy_busy_s=chosen.copies.copy_busy_s,
                budget_s=budget_s,
            )
        )
    return CostPlan(ranks=tuple(ranks), step_s=step_s)


def build_cost_aware_orders(config: ScheduleConfig, cost: CostModel) -> tuple[Order, ...]:
    """Every rank's finalized order with the cost policy's swap steps (identity in effect
    when ``config.swap`` is False: then no order has swap steps)."""
    config, cost = _check_inputs(config, cost)
    if not config.swap:
        return build_all_orders(config)
    chunks = plan_cost_aware(config, cost).chunks
    plain = build_all_orders(replace(config, swap=False))
    return tuple(
        inject_swap_steps(order, config, rank, chunks=chunks) for rank, order in enumerate(plain)
    )


def build_orders(
    config: ScheduleConfig, swap_policy: SwapPolicy = "gap", cost_model: CostModel | None = None
) -> tuple[Order, ...]:
    """Every rank's finalized order under a swap policy: ``"gap"`` is
    ``lowering.build_all_orders``, ``"cost"`` is :func:`build_cost_aware_orders`."""
    check_swap_policy(swap_policy, cost_model)
    if swap_policy == "cost":
        assert cost_model is not None
        return build_cost_aware_orders(config, cost_model)
    return build_all_orders(config)
