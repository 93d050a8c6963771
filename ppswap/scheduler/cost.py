"""The cost-aware swap policy, ``swap_policy="cost"``: copies that hide, within a budget.

The fixed rule (``swap_policy="gap"``, the default) swaps every chunk whose gap is at least
``min_swap_gap`` and ignores how long a copy takes. On a slow link the copies queue on the
rank's single copy stream and SWAP_WAIT_* blocks compute: the *exposed* copy wait. This
policy picks a subset of the fixed rule's chunks so that the *predicted* exposed wait of
every rank stays within a budget (default 2% of the step time) while the predicted peak of
resident chunks of each rank (the memory model of ``ppswap.scheduler.simulate``) is as low
as it can be. The chosen chunks are placed by the fixed rule's anchors
(``swap_plan.inject_swap_steps`` with ``chunks=``): the two policies differ only in
*which* chunks move.

Prediction: ``cost_simulation.simulate_run`` simulates the step event by event from a
:class:`~ppswap.scheduler.cost_model.CostModel` (bytes per chunk, copy bandwidths,
compute time per leaf, per-copy overhead, one device per rank or one shared compute
thread). The step time is that of the orders without swap; each rank's budget is
``budget * headroom * step time``.

Memory without re-planning (``cost_memory``)
    The peak of a rank's profile is always reached at a compute slot, and a swapped chunk
    lowers the profile by one exactly over its *window*: the compute slots from the second
    after its FWD up to the one its SWAP_LAUNCH_LOAD precedes. The anchors do not depend
    on which other chunks move (at slot granularity), so each candidate's window is read
    once from the fixed rule's order, and the effect of adding or removing a chunk on its
    rank's (peak, compute slots at the peak) is computed without building an order.

Selection (candidates: the fixed rule's chunks, of every rank)
    1. If the fixed rule's whole set fits the budget on every rank, take it: with free or
       fast copies the policy is the fixed rule, chunk for chunk.
    2. Otherwise a greedy on memory benefit, starting from no chunk. In each round the
       ranks are visited by their current peak, highest first. At a peak level, the
       remaining candidates of those ranks that lower their rank's profile (its peak, or
       the number of compute slots at it: a window that covers a peak slot) are ranked by
       the new peak, the fewest slots at it, the longest gap, the earliest FWD, the lowest
       rank; candidates whose window covers no peak slot are not simulated. In that order
       each one is simulated with the current selection: the first that keeps every
       rank's budget is added and the round ends; one that breaks a budget is dropped for
       good (on the copy stream of its rank a chunk only adds work, so a chunk that does
       not fit rarely fits later: dropping it is the greedy's approximation). When no
       candidate of a level fits, the next level is tried. The greedy stops when no
       remaining candidate lowers its rank's profile: more copies would only spend
       bandwidth.
    3. Also the other way round: from the fixed rule's set, remove one chunk at a time
       until every rank fits, always from the rank whose exposed wait is furthest over
       the budget (only its own copies make it wait): the chunk whose removal raises that
       rank's (peak, slots at the peak) least, then has the shortest gap, then the latest
       FWD. (Ranks interact through the shared compute thread and the dependencies, so
       adding up and removing down can end at different selections.)
    4. Both results are pruned, last chosen first: a chunk whose removal keeps every
       budget and leaves its rank's peak where it is, is dropped (the policy moves no
       bytes that do not lower a peak). The better of the two is taken: lower peaks,
       largest rank first, then fewer chunks.
    Why a greedy suffices: a swapped chunk lowers its rank's profile by one exactly over
    its window, so a peak drops only when every peak slot is covered; the greedy covers
    peak slots one at a time with the chunk that covers most, and the budget check is the
    simulation's. The candidates are the fixed rule's chunks only, so the policy refines
    the default and never moves more: chunks with gap 2 or 3 would free nothing anyway
    without FSDP (their load is launched where their offload is waited).
    Behaviour: with one device per rank, slower copies or a smaller budget never give a
    lower peak on any rank (tested on every schedule family); with a shared compute thread
    the ranks compete for it and the selection may trade one rank's peak for another's.
    Cost of planning: each simulation adds a chunk, drops one for good, removes one or
    prunes one, so there are at most a few per candidate chunk, and each is linear in the
    steps: quadratic in the chunks overall, with memory effects computed, not simulated.
    GPipe pp4 with copies of 3 compute leaves on a compute thread shared by the ranks
    (the budget binds): 0.017 s at m8, 0.05 s at m16, 0.17 s at m32 and 0.6 s at m64,
    best of 3 on this project's 2-core machine, up to 2.5 times that while it is loaded
    (``benchmarks/bench_plan.py``). The runtime plans once per run.

Nothing here imports MindSpore or anyio; every function is pure. The policy is not a step
of ``lowering.build_exec_order`` because the memory model (``simulate``) imports lowering:
callers with a policy use :func:`build_orders` (the runtime does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal, get_args

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_memory import Candidate, RankMemory, candidates_of
from ppswap.scheduler.cost_model import DEFAULT_COST_BUDGET, CostModel
from ppswap.scheduler.cost_simulation import Program, RunEstimate, Simulator, simulate_run
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.peak import build_peak_orders
from ppswap.scheduler.steps import Order
from ppswap.scheduler.swap_plan import inject_swap_steps

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

SwapPolicy = Literal["gap", "cost", "peak"]
SWAP_POLICIES: tuple[str, ...] = get_args(SwapPolicy)
_TOLERANCE_S = 1e-12
Chunk = tuple[int, int]
Selection = tuple[frozenset[Chunk], ...]


def check_swap_policy(swap_policy: object, cost_model: object) -> None:
    """Refuse a bad ``swap_policy`` / ``cost_model`` pair (TypeError or ValueError).

    ``"gap"`` and ``"peak"`` take no cost model; ``"cost"`` needs a :class:`CostModel`. The
    policy only matters when swap is on: with ``swap=False`` nothing is swapped either way.
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
    if swap_policy != "cost" and cost_model is not None:
        raise ValueError(
            f"cost_model is only used with swap_policy='cost'; got swap_policy={swap_policy!r} "
            f"and cost_model={cost_model!r}"
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
class _Outcome:
    """A selection with its memory (per rank) and its simulated step."""

    selection: Selection
    memory: tuple[RankMemory, ...]
    estimate: RunEstimate


class _Planner:
    """Simulates selections (one chunk set per rank) of one schedule, with a cache of each
    rank's program per chunk set (a helper of ``plan_cost_aware``)."""

    def __init__(self, config: ScheduleConfig, plain: Sequence[Order], cost: CostModel) -> None:
        self.config = replace(config, swap=True)
        self.plain = plain
        self.simulator = Simulator(config, plain, cost)
        self._programs: dict[tuple[int, frozenset[Chunk]], Program] = {}

    def _program(self, rank: int, chunks: frozenset[Chunk]) -> Program:
        key = (rank, chunks)
        program = self._programs.get(key)
        if program is None:
            order = inject_swap_steps(self.plain[rank], self.config, rank, chunks=chunks)
            program = self.simulator.program(rank, order)
            self._programs[key] = program
        return program

    def run(self, selection: Selection) -> RunEstimate:
        return self.simulator.run(
            [self._program(rank, chunks) for rank, chunks in enumerate(selection)]
        )

    def outcome(self, selection: Selection, memory: tuple[RankMemory, ...]) -> _Outcome:
        return _Outcome(selection, memory, self.run(selection))


def _toggled(selection: Selection, candidate: Candidate, add: bool) -> Selection:
    """``selection`` with ``candidate``'s chunk added to or removed from its rank's set."""
    rank = candidate.rank
    chunks = selection[rank]
    chunks = chunks | {candidate.chunk} if add else chunks - {candidate.chunk}
    return (*selection[:rank], chunks, *selection[rank + 1 :])


def _trial(planner: _Planner, outcome: _Outcome, candidate: Candidate, add: bool) -> RunEstimate:
    """The simulated step of ``outcome``'s selection with ``candidate`` added or removed."""
    return planner.run(_toggled(outcome.selection, candidate, add))


def _change(outcome: _Outcome, candidate: Candidate, add: bool, estimate: RunEstimate) -> _Outcome:
    """``outcome`` with ``candidate`` added or removed (``estimate``: its ``_trial``)."""
    rank = candidate.rank
    memory = outcome.memory[rank].changed(candidate, -1 if add else 1)
    return _Outcome(
        _toggled(outcome.selection, candidate, add),
        (*outcome.memory[:rank], memory, *outcome.memory[rank + 1 :]),
        estimate,
    )


def _fits(estimate: RunEstimate, budget_s: float) -> bool:
    return max(estimate.exposed_s, default=0.0) <= budget_s + _TOLERANCE_S


def _greedy(
    planner: _Planner,
    candidates: Sequence[Sequence[Candidate]],
    empty: _Outcome,
    budget_s: float,
) -> _Outcome:
    """Step 2 of the selection, then the pruning (module docstring)."""
    current = empty
    remaining = [list(rank_candidates) for rank_candidates in candidates]
    added: list[Candidate] = []
    while True:
        picked: tuple[Candidate, RunEstimate] | None = None
        levels = {current.memory[rank].peak for rank, left in enumerate(remaining) if left}
        for level in sorted(levels, reverse=True):
            pool: list[tuple[tuple[int, int, int, int, int, Chunk], Candidate]] = []
            for rank, left in enumerate(remaining):
                memory = current.memory[rank]
                if memory.peak != level:
                    continue
                for candidate in left:
                    peak, count = memory.with_chunk(candidate)
                    if (peak, count) < (memory.peak, memory.count):
                        key = (peak, count, -candidate.gap, candidate.fwd_slot, rank)
                        pool.append(((*key, candidate.chunk), candidate))
            pool.sort(key=lambda item: item[0])
            for _, candidate in pool:
                estimate = _trial(planner, current, candidate, add=True)
                remaining[candidate.rank].remove(candidate)  # chosen, or dropped for good
                if _fits(estimate, budget_s):
                    picked = (candidate, estimate)
                    break
            if picked is not None:
                break
        if picked is None:
            break
        candidate, estimate = picked
        current = _change(current, candidate, True, estimate)
        added.append(candidate)
    return _prune(planner, current, added, budget_s)


def _prune(
    planner: _Planner, current: _Outcome, chosen: Sequence[Candidate], budget_s: float
) -> _Outcome:
    """Step 4: drop, last chosen first, every chunk whose removal keeps every budget and
    its rank's peak."""
    for candidate in reversed(chosen):
        memory = current.memory[candidate.rank]
        if memory.without_chunk(candidate)[0] > memory.peak:
            continue  # it holds its rank's peak down
        estimate = _trial(planner, current, candidate, add=False)
        if _fits(estimate, budget_s):
            current = _change(current, candidate, False, estimate)
    return current


def _removal(
    planner: _Planner,
    candidates: Sequence[Sequence[Candidate]],
    full: _Outcome,
    budget_s: float,
) -> _Outcome:
    """Step 3: from the fixed rule's set, remove one chunk at a time until every rank fits
    (module docstring)."""
    current = full
    while not _fits(current.estimate, budget_s):
        exposed = current.estimate.exposed_s
        rank = max(range(len(exposed)), key=exposed.__getitem__)
        memory = current.memory[rank]
        chosen = current.selection[rank]
        removed = min(
            (c for c in candidates[rank] if c.chunk in chosen),
            key=lambda c: (*memory.without_chunk(c), c.gap, -c.fwd_slot, c.chunk),
        )
        current = _change(current, removed, False, _trial(planner, current, removed, False))
    kept = [c for rank_candidates in candidates for c in rank_candidates]
    kept = [c for c in kept if c.chunk in current.selection[c.rank]]
    return _prune(planner, current, kept, budget_s)


def _better(first: _Outcome, second: _Outcome) -> _Outcome:
    """The selection with the lower peaks (largest rank first), then fewer chunks."""

    def rank_key(outcome: _Outcome) -> tuple[list[int], int]:
        peaks = sorted((memory.peak for memory in outcome.memory), reverse=True)
        return peaks, sum(len(chunks) for chunks in outcome.selection)

    return second if rank_key(second) < rank_key(first) else first


def _plan(config: ScheduleConfig, cost: CostModel, plain: Sequence[Order]) -> CostPlan:
    """``plan_cost_aware`` on the swap-free orders ``plain`` (one per rank)."""
    planner = _Planner(config, plain, cost)
    found = [candidates_of(planner.config, rank, order) for rank, order in enumerate(plain)]
    candidates = [rank_candidates for rank_candidates, _ in found]
    base = tuple(memory for _, memory in found)
    empty = planner.outcome(tuple(frozenset() for _ in plain), base)
    step_s = empty.estimate.step_s
    budget_s = cost.budget * cost.headroom * step_s
    fixed = tuple(frozenset(c.chunk for c in rank_candidates) for rank_candidates in candidates)
    full_memory = tuple(
        memory.changed_by(rank_candidates, -1)
        for memory, rank_candidates in zip(base, candidates, strict=True)
    )
    full = planner.outcome(fixed, full_memory)
    if _fits(full.estimate, budget_s):
        chosen = full
    else:
        chosen = _better(
            _greedy(planner, candidates, empty, budget_s),
            _removal(planner, candidates, full, budget_s),
        )
    return CostPlan(
        ranks=tuple(
            RankCostPlan(
                rank=rank,
                chunks=chosen.selection[rank],
                candidates=fixed[rank],
                peak_chunks=chosen.memory[rank].peak,
                peak_chunks_gap=full.memory[rank].peak,
                peak_chunks_no_swap=base[rank].peak,
                exposed_s=chosen.estimate.exposed_s[rank],
                exposed_s_gap=full.estimate.exposed_s[rank],
                copy_busy_s=chosen.estimate.copy_busy_s[rank],
                budget_s=budget_s,
            )
            for rank in range(config.pp)
        ),
        step_s=step_s,
    )


def plan_cost_aware(config: ScheduleConfig, cost: CostModel) -> CostPlan:
    """Choose every rank's chunks under ``cost`` (module docstring); ``config.swap`` is
    treated as True. Raises TypeError/ValueError for bad inputs."""
    config, cost = _check_inputs(config, cost)
    return _plan(config, cost, build_all_orders(replace(config, swap=False)))


def build_cost_aware_orders(config: ScheduleConfig, cost: CostModel) -> tuple[Order, ...]:
    """Every rank's finalized order with the cost policy's swap steps (identity in effect
    when ``config.swap`` is False: then no order has swap steps). The swap-free orders are
    lowered once, for the plan and for the result."""
    config, cost = _check_inputs(config, cost)
    if not config.swap:
        return build_all_orders(config)
    plain = build_all_orders(replace(config, swap=False))
    chunks = _plan(config, cost, plain).chunks
    return tuple(
        inject_swap_steps(order, config, rank, chunks=chunks) for rank, order in enumerate(plain)
    )


def build_orders(
    config: ScheduleConfig, swap_policy: SwapPolicy = "gap", cost_model: CostModel | None = None
) -> tuple[Order, ...]:
    """Every rank's finalized order under a swap policy: ``"gap"`` is
    ``lowering.build_all_orders``, ``"cost"`` is :func:`build_cost_aware_orders`, ``"peak"``
    is ``peak.build_peak_orders``."""
    check_swap_policy(swap_policy, cost_model)
    if swap_policy == "cost":
        assert cost_model is not None
        return build_cost_aware_orders(config, cost_model)
    if swap_policy == "peak":
        return build_peak_orders(config)
    return build_all_orders(config)
