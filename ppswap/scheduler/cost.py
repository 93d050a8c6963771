"""The cost-aware swap policy, ``swap_policy="cost"`` (RFC section 3.2, follow-up 4).

The fixed rule (``swap_policy="gap"``, the default) swaps every chunk whose gap is at least
``min_swap_gap`` and ignores how long a copy takes. On a slow link the copies queue on the
rank's single copy stream and SWAP_WAIT_* blocks compute: the *exposed* copy wait. This
policy picks a subset of the fixed rule's chunks so that the *predicted* exposed wait of
every rank stays within a budget (default 2% of the step time) while the predicted peak of
resident chunks of each rank (the memory model of ``ppswap.scheduler.simulate``) is as low
as it can be. The chosen chunks are placed by the fixed rule's anchors
(``swap_plan.inject_swap_steps`` with ``chunks=``): the two policies differ only in
*which* chunks move.

Prediction: ``cost_model.simulate_run`` simulates the step event by event from a
:class:`~ppswap.scheduler.cost_model.CostModel` (bytes per chunk, copy bandwidths,
compute time per leaf, per-copy overhead, one device per rank or one shared compute
thread). The step time is that of the orders without swap; each rank's budget is
``budget * step time``.

Selection (candidates: the fixed rule's chunks, of every rank)
    1. If the fixed rule's whole set fits the budget on every rank, take it: with free or
       fast copies the policy is the fixed rule, chunk for chunk.
    2. Otherwise a greedy on memory benefit, starting from no chunk. Each round adds every
       remaining candidate in turn to the current selection and simulates the step;
       candidates that break some rank's budget are dropped for good (on the copy stream
       of its rank a chunk only adds work, so a chunk that does not fit rarely fits
       later: dropping it is the greedy's approximation). Among the others, those that
       lower their rank's profile (its peak, or the number of steps at that peak) compete;
       the winner is the one whose rank has the highest peak (ranks are visited by peak,
       and the round ends at the first peak level with such a candidate), then the lowest
       new peak, the fewest steps at it, the least worst-rank exposed wait, the longest
       gap, the earliest FWD, the lowest rank. The greedy stops when no candidate lowers
       its rank's profile: no remaining chunk is off device at a peak step of its rank, so
       more copies would only spend bandwidth.
    3. Also the other way round: from the fixed rule's set, remove one chunk at a time
       until every rank fits: the chunk whose removal cuts the exposed wait beyond the
       budgets most, then raises its rank's profile least, then has the shortest gap.
       (Ranks interact through the shared compute thread and the dependencies, so adding
       up and removing down can end at different selections.)
    4. Both results are pruned, last chosen first: a chunk whose removal keeps every
       budget and leaves its rank's peak where it is, is dropped (the policy moves no
       bytes that do not lower a peak). The better of the two is taken: lower peaks,
       largest rank first, then fewer chunks.
    Why a greedy suffices: a swapped chunk lowers its rank's profile by one exactly over
    its off-device window, so a peak drops only when every peak step is covered; the greedy
    covers peak steps one at a time with the chunk that costs least, and the budget check
    is the simulation's. The candidates are the fixed rule's chunks only, so the policy
    refines the default and never moves more: chunks with gap 2 or 3 would free nothing
    anyway without FSDP (their load is launched where their offload is waited).
    Behaviour: with one device per rank, slower copies or a smaller budget never give a
    lower peak on any rank (tested on every schedule family); with a shared compute thread
    the ranks compete for it and the selection may trade one rank's peak for another's.
    Cost of planning: one simulation per candidate and round (quadratic in the chunks
    when the budget binds; milliseconds to a second at pp4 m8, see bench_scale.py). The
    runtime plans once per run.

Nothing here imports MindSpore or anyio; every function is pure. The policy is not a step
of ``lowering.build_exec_order`` because the memory model (``simulate``) imports lowering:
callers with a policy use :func:`build_orders` (the runtime does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import (
    DEFAULT_COST_BUDGET,
    CostModel,
    RunEstimate,
    Simulator,
    simulate_run,
)
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.simulate import memory_profile
from ppswap.scheduler.steps import Order
from ppswap.scheduler.swap_plan import inject_swap_steps, plan_swap

__all__ = [
    "DEFAULT_COST_BUDGET",
    "SWAP_POLICIES",
    "CostModel",
    "CostPlan",
    "RankCostPlan",
    "RunEstimate",
    "SwapPolicy",
    "build_cost_aware_orders",
    "build_orders",
    "check_swap_policy",
    "plan_cost_aware",
    "simulate_run",
]

SwapPolicy = Literal["gap", "cost"]
SWAP_POLICIES: tuple[str, ...] = get_args(SwapPolicy)
_TOLERANCE_S = 1e-12
Chunk = tuple[int, int]


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
    cost.check_for(config)
    if config.forward_only:
        raise ValueError("the cost policy needs a backward: config.forward_only must be False")
    return config, cost


@dataclass(frozen=True, slots=True)
class RankCostPlan:
    """The cost policy's choice for one rank, with the fixed rule's figures beside it.

    ``candidates`` are the fixed rule's chunks, ``chunks`` the chosen ones. Peaks are in
    resident chunks (``simulate.memory_profile``), times in seconds of the simulation.
    ``budget_s`` is what the prediction may use: ``budget * headroom`` of the step.
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
    """The cost policy's choice for every rank; ``step_s`` is the simulated step time
    without swap (the budget's base)."""

    ranks: tuple[RankCostPlan, ...]
    step_s: float

    @property
    def chunks(self) -> frozenset[Chunk]:
        """Every chosen chunk of every rank (the ``chunks=`` of ``inject_swap_steps``)."""
        return frozenset(chunk for rank in self.ranks for chunk in rank.chunks)


@dataclass(frozen=True, slots=True)
class _Candidate:
    rank: int
    chunk: Chunk
    gap: int
    fwd_slot: int


@dataclass(frozen=True, slots=True)
class _Evaluation:
    selection: tuple[frozenset[Chunk], ...]
    peaks: tuple[tuple[int, int], ...]  # per rank: (peak, steps at the peak)
    estimate: RunEstimate


class _Planner:
    """Evaluates selections (one chunk set per rank) of one schedule, with a cache of each
    rank's swapped order and profile (a helper of ``plan_cost_aware``)."""

    def __init__(self, config: ScheduleConfig, plain: Sequence[Order], cost: CostModel) -> None:
        self.config = replace(config, swap=True)
        self.plain = plain
        self.simulator = Simulator(config, plain, cost)
        self._ranks: dict[tuple[int, frozenset[Chunk]], tuple[Any, tuple[int, int]]] = {}

    def _rank(self, rank: int, chunks: frozenset[Chunk]) -> tuple[Any, tuple[int, int]]:
        """Rank ``rank`` swapping ``chunks``: its simulator program and (peak, steps at it)."""
        key = (rank, chunks)
        if key not in self._ranks:
            order = inject_swap_steps(self.plain[rank], self.config, rank, chunks=chunks)
            profile = memory_profile(order)
            peak = max(profile, default=0)
            program = self.simulator.program(rank, order)
            self._ranks[key] = (program, (peak, profile.count(peak)))
        return self._ranks[key]

    def evaluate(self, selection: tuple[frozenset[Chunk], ...]) -> _Evaluation:
        ranks = [self._rank(rank, chunks) for rank, chunks in enumerate(selection)]
        estimate = self.simulator.run([program for program, _ in ranks])
        return _Evaluation(selection, tuple(peak for _, peak in ranks), estimate)


def _fits(evaluation: _Evaluation, budget_s: float) -> bool:
    return max(evaluation.estimate.exposed_s, default=0.0) <= budget_s + _TOLERANCE_S


def _with(
    selection: tuple[frozenset[Chunk], ...], rank: int, chunks: frozenset[Chunk]
) -> tuple[frozenset[Chunk], ...]:
    return (*selection[:rank], chunks, *selection[rank + 1 :])


def _greedy(planner: _Planner, candidates: Sequence[_Candidate], budget_s: float) -> _Evaluation:
    """Step 2 of the selection, then the pruning (module docstring)."""
    current = planner.evaluate(tuple(frozenset() for _ in planner.plain))
    remaining = list(candidates)
    added: list[_Candidate] = []
    while remaining:
        best: tuple[tuple[float, ...], _Evaluation, _Candidate] | None = None
        dropped: set[_Candidate] = set()
        # The winner comes from the ranks with the highest current peak that have an
        # improving candidate: visit the ranks by peak, stop at the first level that has one.
        for level in sorted({current.peaks[c.rank][0] for c in remaining}, reverse=True):
            for candidate in remaining:
                rank = candidate.rank
                if current.peaks[rank][0] != level:
                    continue
                trial = planner.evaluate(
                    _with(current.selection, rank, current.selection[rank] | {candidate.chunk})
                )
                if not _fits(trial, budget_s):
                    dropped.add(candidate)
                    continue
                if trial.peaks[rank] >= current.peaks[rank]:
                    continue
                key = (
                    *trial.peaks[rank],
                    max(trial.estimate.exposed_s),
                    -candidate.gap,
                    candidate.fwd_slot,
                    rank,
                )
                if best is None or key < best[0]:
                    best = (key, trial, candidate)
            if best is not None:
                break
        if best is None:
            break
        _, current, chosen = best
        added.append(chosen)
        remaining = [c for c in remaining if c != chosen and c not in dropped]
    return _prune(planner, current, added, budget_s)


def _prune(
    planner: _Planner, current: _Evaluation, chosen: Sequence[_Candidate], budget_s: float
) -> _Evaluation:
    """Step 4: drop, last chosen first, every chunk whose removal keeps every budget and
    its rank's peak."""
    for candidate in reversed(chosen):
        rank = candidate.rank
        trial = planner.evaluate(
            _with(current.selection, rank, current.selection[rank] - {candidate.chunk})
        )
        if _fits(trial, budget_s) and trial.peaks[rank][0] <= current.peaks[rank][0]:
            current = trial
    return current


def _excess(evaluation: _Evaluation, budget_s: float) -> float:
    return sum(max(0.0, exposed - budget_s) for exposed in evaluation.estimate.exposed_s)


def _removal(
    planner: _Planner, candidates: Sequence[_Candidate], full: _Evaluation, budget_s: float
) -> _Evaluation:
    """Step 3: from the fixed rule's set, remove one chunk at a time until every rank fits:
    the one whose removal cuts the exposed wait beyond the budgets most, then raises its
    rank's (peak, steps at peak) least, then has the shortest gap."""
    current = full
    remaining = list(candidates)
    while remaining and not _fits(current, budget_s):
        best: tuple[tuple[float, ...], _Evaluation, _Candidate] | None = None
        for candidate in remaining:
            rank = candidate.rank
            trial = planner.evaluate(
                _with(current.selection, rank, current.selection[rank] - {candidate.chunk})
            )
            key = (
                _excess(trial, budget_s),
                *trial.peaks[rank],
                candidate.gap,
                -candidate.fwd_slot,
                rank,
            )
            if best is None or key < best[0]:
                best = (key, trial, candidate)
        assert best is not None
        _, current, removed = best
        remaining.remove(removed)
    kept = [candidate for candidate in candidates if candidate in remaining]
    return _prune(planner, current, kept, budget_s)


def _better(first: _Evaluation, second: _Evaluation) -> _Evaluation:
    """The selection with the lower peaks (largest rank first), then fewer chunks."""

    def rank_key(evaluation: _Evaluation) -> tuple[list[int], int]:
        peaks = sorted((peak for peak, _ in evaluation.peaks), reverse=True)
        return peaks, sum(len(chunks) for chunks in evaluation.selection)

    return second if rank_key(second) < rank_key(first) else first


def plan_cost_aware(config: ScheduleConfig, cost: CostModel) -> CostPlan:
    """Choose every rank's chunks under ``cost`` (module docstring); ``config.swap`` is
    treated as True. Raises TypeError/ValueError for bad inputs."""
    config, cost = _check_inputs(config, cost)
    plain = build_all_orders(replace(config, swap=False))
    planner = _Planner(config, plain, cost)
    none = planner.evaluate(tuple(frozenset() for _ in plain))
    step_s = none.estimate.step_s
    budget_s = cost.budget * cost.headroom * step_s
    candidates = [
        _Candidate(rank, plan.chunk, plan.gap, plan.fwd_slot)
        for rank, order in enumerate(plain)
        for plan in plan_swap(order, planner.config)
        if plan.eligible
    ]
    fixed = tuple(
        frozenset(c.chunk for c in candidates if c.rank == rank) for rank in range(config.pp)
    )
    full = planner.evaluate(fixed)
    if _fits(full, budget_s):
        chosen = full
    else:
        chosen = _better(
            _greedy(planner, candidates, budget_s),
            _removal(planner, candidates, full, budget_s),
        )
    return CostPlan(
        ranks=tuple(
            RankCostPlan(
                rank=rank,
                chunks=chosen.selection[rank],
                candidates=fixed[rank],
                peak_chunks=chosen.peaks[rank][0],
                peak_chunks_gap=full.peaks[rank][0],
                peak_chunks_no_swap=none.peaks[rank][0],
                exposed_s=chosen.estimate.exposed_s[rank],
                exposed_s_gap=full.estimate.exposed_s[rank],
                copy_busy_s=chosen.estimate.copy_busy_s[rank],
                budget_s=budget_s,
            )
            for rank in range(config.pp)
        ),
        step_s=step_s,
    )


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
