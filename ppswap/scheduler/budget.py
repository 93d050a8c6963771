"""The memory-budget planner, ``memory_budget=``: keep, swap or recompute each chunk so that
every rank's predicted peak of saved bytes fits its budget, at the least predicted step.

Inputs: the schedule (``ScheduleConfig``; ``swap=True`` lets the planner swap), a
:class:`~ppswap.scheduler.cost_model.CostModel` with ``stage_bytes`` (what a chunk of each
stage keeps, moves, holds recomputed and regenerates: ``CostModel.from_result`` measures
them) and its times, a budget in bytes per rank, and the stages whose chunks may be
recomputed (those with a ``recompute_wrapper`` block). A policy whose bytes were not
measured on a stage is not used there.

The memory model, in bytes, at every compute slot of a rank's swap-free order (the peak
is reached at a compute slot: docs/memory-model.md). A chunk counts from its FWD's slot
to its release: its consumer's slot (BWD, or BWD_INPUT), or with the dx/dw split and
``config.saved_until="weight"`` its BWD_WEIGHT's (torch frees a split chunk only there;
MindSpore at its BWD_INPUT, ``"input"``):

- kept: ``kept`` bytes throughout;
- swapped (the gap rule's chunks only: ``swap_plan``'s anchors): ``kept - moved`` over its
  window (``cost_memory``: from the second slot after its FWD to the one its load
  precedes), ``kept`` elsewhere;
- recomputed: ``recompute_held`` from its FWD up to its consumer; from the consumer's slot
  to its release ``recompute_held + regenerated`` (its RECOMPUTE runs between the slot
  before and the consumer, so no slot sees more than the consumer's).

Selection, per rank (a rank's memory depends on its own order only):

1. Greedy: while the rank's peak is over its budget, take its first slot at the peak and,
   among the kept chunks live there, the option (swap or recompute) with the most bytes
   saved at that slot per predicted second, ties to the longest lifespan (FWD to
   release), then the chunk. Predicted seconds: a recompute costs ``recompute_s`` on
   the compute thread; a swap its two compute-thread jobs (``swap_step_s`` each) and the
   part of each copy a compute slot does not hide. When no option lowers that slot the
   rank is stuck: the budget is impossible, and the least peak the greedy went through is
   the least budget it can meet (``BudgetError``, a ValueError naming ``memory_budget``).
2. Local improvement: every chosen chunk, costliest first, goes back to keep where the
   peak stays within the budget; then a chosen chunk whose other option (swap for a
   recompute, recompute for a swap) is cheaper takes it where the peak stays within the
   budget.
3. Whole-step check: the per-chunk seconds above ignore the copy stream's queue (slow
   copies back to back wait for each other) and what a stall costs the other ranks, so
   the plan is compared by ``simulate_run`` with its chosen chunks all recomputed, all
   swapped (where each fits), every chunk recomputed, every chunk swapped, and every
   chunk kept, the same candidate on every rank where it fits that rank's budget (else
   the rank's plan): the least predicted step wins. The simple policies are among the
   candidates, so where one fits, the plan's predicted step is at most its.

The chosen policies become orders through ``recompute_plan.orders_for_policies``, checked
by ``validate_all``; the step is predicted by ``cost_simulation.simulate_run`` (RECOMPUTE takes
its time on the compute thread). Cost: one pass over the live chunks per choice, linear
in the slots per improvement trial; Interleaved pp8 vpp2 m64 plans in well under a second
(``benchmarks/bench_budget.py``).

Nothing here imports a framework or anyio; every function is pure.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ppswap.scheduler.analysis import compute_slots
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_calibration import StageBytes
from ppswap.scheduler.cost_memory import candidates_of
from ppswap.scheduler.cost_model import CostModel
from ppswap.scheduler.cost_simulation import simulate_run
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.recompute_plan import ChunkPolicy, orders_for_policies
from ppswap.scheduler.simulate import releases_chunk, split_release_kind
from ppswap.scheduler.steps import (
    CONSUMER_KINDS,
    FWD,
    SWAP_LAUNCH_LOAD,
    SWAP_LAUNCH_OFFLOAD,
    Order,
)
from ppswap.scheduler.validate import validate_all

__all__ = ["BudgetError", "BudgetPlan", "RankBudgetPlan", "plan_memory_budget"]

Chunk = tuple[int, int]
_Delta = tuple[tuple[int, int, int], ...]
"""A policy's effect on a rank's bytes: (first slot, slot after the last, bytes added)."""


class BudgetError(ValueError):
    """A budget below the least peak the planner reaches on some rank."""


@dataclass(frozen=True, slots=True)
class RankBudgetPlan:
    """The plan of one rank: its budget, each of its chunks' policy, the predicted peak
    of saved bytes, and the predicted peaks of keeping everything and of the least the
    planner reaches (the least budget it can meet)."""

    rank: int
    budget: int
    policies: tuple[tuple[Chunk, ChunkPolicy], ...]
    peak_bytes: int
    keep_peak_bytes: int
    least_bytes: int


@dataclass(frozen=True, slots=True)
class BudgetPlan:
    """The plan of every rank, the finalized orders and the predicted step (seconds, of
    ``cost_simulation.simulate_run``), with keeping everything's beside it."""

    ranks: tuple[RankBudgetPlan, ...]
    orders: tuple[Order, ...]
    step_s: float
    keep_step_s: float

    @property
    def policies(self) -> dict[Chunk, ChunkPolicy]:
        """Every chunk's policy, of every rank."""
        return {chunk: policy for rank in self.ranks for chunk, policy in rank.policies}


@dataclass(frozen=True, slots=True)
class _Option:
    policy: ChunkPolicy
    delta: _Delta
    seconds: float


@dataclass(frozen=True, slots=True)
class _ChunkModel:
    chunk: Chunk
    first: int
    last: int
    options: tuple[_Option, ...]


@dataclass(frozen=True, slots=True)
class _RankPlanning:
    """One rank's steps 1-2 result and step 3's candidates (``_alternatives``)."""

    models: list[_ChunkModel]
    state: _RankState
    alternatives: dict[str, _RankState]
    keep_peak: int
    least: int


class _RankState:
    """The bytes of one rank at each compute slot under the current policies."""

    def __init__(self, values: Sequence[int]) -> None:
        self.values = list(values)
        self.chosen: dict[Chunk, _Option] = {}

    def apply(self, delta: _Delta, sign: int) -> None:
        values = self.values
        for start, end, nbytes in delta:
            for slot in range(start, end):
                values[slot] += sign * nbytes

    def peak(self) -> int:
        return max(self.values, default=0)

    def fits_with(self, delta: _Delta, sign: int, budget: int) -> bool:
        """Whether the peak is within ``budget`` with ``delta`` applied (left unapplied)."""
        self.apply(delta, sign)
        fits = self.peak() <= budget
        self.apply(delta, -sign)
        return fits


def _delta_at(delta: _Delta, slot: int) -> int:
    return sum(nbytes for start, end, nbytes in delta if start <= slot < end)


def _check_budgets(config: ScheduleConfig, budgets: object) -> tuple[int, ...]:
    if not isinstance(budgets, tuple) or len(budgets) != config.pp:
        raise ValueError(
            f"budgets must be a tuple of one int per rank ({config.pp}), got {budgets!r}"
        )
    for value in budgets:
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"memory_budget must be a positive int per rank, got {budgets!r}")
    return budgets


def _stage_bytes(cost: CostModel, config: ScheduleConfig) -> tuple[StageBytes, ...]:
    cost.check_for(config)
    if cost.stage_bytes is None:
        raise ValueError(
            "memory_budget needs measured chunk bytes: cost_model=CostModel.from_result(result) "
            "of an earlier step of these stages (got a cost_model without stage_bytes)"
        )
    return cost.stage_bytes


def _chunk_models(
    config: ScheduleConfig,
    rank: int,
    plain: Order,
    cost: CostModel,
    sizes: Sequence[StageBytes],
    recompute_stages: frozenset[int],
) -> tuple[list[_ChunkModel], list[int]]:
    """The chunks of a rank with their options, and its bytes with every chunk kept."""
    first: dict[Chunk, int] = {}
    consumer: dict[Chunk, int] = {}
    last: dict[Chunk, int] = {}
    split_release = split_release_kind(config.saved_until)
    slots = compute_slots(plain)
    for slot in slots:
        for leaf in slot.leaves:
            if leaf.kind is FWD:
                first[leaf.chunk] = slot.slot
            if leaf.kind in CONSUMER_KINDS:
                consumer[leaf.chunk] = slot.slot
            if releases_chunk(leaf.kind, split_release):
                last[leaf.chunk] = slot.slot
    windows: dict[Chunk, tuple[int, int]] = {}
    if config.swap:
        candidates, _ = candidates_of(config, rank, plain)
        windows = {c.chunk: (c.start, c.end) for c in candidates if c.end > c.start}
    hidden = cost.leaf_s  # a copy overlaps about one compute slot before its wait
    values = [0] * len(slots)
    models: list[_ChunkModel] = []
    for chunk, fwd in first.items():
        if chunk not in consumer:
            continue
        size = sizes[chunk[0]]
        end = last[chunk] + 1
        for index in range(fwd, end):
            values[index] += size.kept
        options: list[_Option] = []
        if chunk in windows and size.moved:
            start, stop = windows[chunk]
            exposed = max(cost.copy_s(SWAP_LAUNCH_OFFLOAD, chunk[0]) - hidden, 0.0) + max(
                cost.copy_s(SWAP_LAUNCH_LOAD, chunk[0]) - hidden, 0.0
            )
            seconds = 2 * cost.swap_step_s + exposed
            options.append(_Option("swap", ((start, stop, -min(size.moved, size.kept)),), seconds))
        if (
            chunk[0] in recompute_stages
            and size.recompute_held is not None
            and size.regenerated is not None
        ):
            back = size.recompute_held + size.regenerated - size.kept
            delta: _Delta = (
                (fwd, consumer[chunk], size.recompute_held - size.kept),
                (consumer[chunk], end, back),
            )
            options.append(_Option("recompute", delta, cost.recompute_s))
        models.append(_ChunkModel(chunk, fwd, end - 1, tuple(options)))
    return models, values


def _greedy(models: Sequence[_ChunkModel], state: _RankState, budget: int) -> tuple[bool, int]:
    """Step 1 (module docstring): whether the budget was met, and the least peak seen."""
    tiny = 1e-9
    least = state.peak()
    while True:
        peak = state.peak()
        least = min(least, peak)
        if peak <= budget:
            return True, least
        at = state.values.index(peak)
        best: tuple[tuple[float, int, Chunk, str], _ChunkModel, _Option] | None = None
        for model in models:
            if model.chunk in state.chosen or not model.first <= at <= model.last:
                continue
            for option in model.options:
                saved = -_delta_at(option.delta, at)
                if saved <= 0:
                    continue
                key = (-saved / (option.seconds + tiny), model.first - model.last, model.chunk)
                full = (*key, option.policy)
                if best is None or full < best[0]:
                    best = (full, model, option)
        if best is None:
            return False, least
        _, model, option = best
        state.chosen[model.chunk] = option
        state.apply(option.delta, 1)


def _uniform(models: Sequence[_ChunkModel], values: Sequence[int], prefer: str) -> _RankState:
    """Every chunk under its ``prefer`` option where it has one, else its other option."""
    state = _RankState(values)
    for model in models:
        options = sorted(model.options, key=lambda o: o.policy != prefer)
        if options:
            state.chosen[model.chunk] = options[0]
            state.apply(options[0].delta, 1)
    return state


def _plan_rank(
    models: Sequence[_ChunkModel], values: Sequence[int], budget: int
) -> tuple[_RankState | None, int]:
    """Steps 1 and 2 for one rank: its state within ``budget`` (None: impossible) and the
    least peak seen. Where the greedy is stuck, recomputing (or swapping) every chunk it
    can is tried too: the greedy works at one slot at a time and may miss that state."""
    state = _RankState(values)
    met, least = _greedy(models, state, budget)
    if not met:
        for prefer in ("recompute", "swap"):
            uniform = _uniform(models, values, prefer)
            least = min(least, uniform.peak())
            if not met and uniform.peak() <= budget:
                met, state = True, uniform
    if not met:
        return None, least
    _improve(models, state, budget)
    return state, least


def _improve(models: Sequence[_ChunkModel], state: _RankState, budget: int) -> None:
    """Step 2 (module docstring)."""
    by_chunk = {model.chunk: model for model in models}
    for chunk, option in sorted(state.chosen.items(), key=lambda item: -item[1].seconds):
        if state.fits_with(option.delta, -1, budget):
            state.apply(option.delta, -1)
            del state.chosen[chunk]
    for chunk, option in sorted(state.chosen.items()):
        other = next((o for o in by_chunk[chunk].options if o.policy != option.policy), None)
        if other is None or other.seconds >= option.seconds:
            continue
        state.apply(option.delta, -1)
        if state.fits_with(other.delta, 1, budget):
            state.apply(other.delta, 1)
            state.chosen[chunk] = other
        else:
            state.apply(option.delta, 1)


def _alternatives(
    models: Sequence[_ChunkModel], values: Sequence[int], state: _RankState, budget: int
) -> dict[str, _RankState]:
    """Step 3's candidates for one rank (module docstring), each within ``budget``: the
    chunks ``state`` chose, all recomputed or all swapped where they can be; every chunk
    recomputed or swapped where it can be; every chunk kept."""
    by_chunk = {model.chunk: model for model in models}
    found: dict[str, _RankState] = {}
    for prefer in ("recompute", "swap"):
        chosen = _RankState(values)
        for chunk, option in state.chosen.items():
            options = sorted(by_chunk[chunk].options, key=lambda o: o.policy != prefer)
            picked = options[0] if options[0].policy == prefer else option
            chosen.chosen[chunk] = picked
            chosen.apply(picked.delta, 1)
        found[f"chosen as {prefer}"] = chosen
        found[f"every {prefer}"] = _uniform(models, values, prefer)
    found["keep"] = _RankState(values)
    return {name: alt for name, alt in found.items() if alt.peak() <= budget}


def _check_inputs(config: object, cost: object) -> tuple[ScheduleConfig, CostModel]:
    if not isinstance(config, ScheduleConfig):
        raise TypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    if not isinstance(cost, CostModel):
        raise TypeError(f"cost_model must be a CostModel, got {type(cost).__name__}")
    if config.forward_only:
        raise ValueError("memory_budget needs a backward: config.forward_only must be False")
    return config, cost


@functools.lru_cache(maxsize=4)
def plan_memory_budget(
    config: ScheduleConfig,
    cost: CostModel,
    budgets: tuple[int, ...],
    recompute_stages: frozenset[int] = frozenset(),
) -> BudgetPlan:
    """The plan of the module docstring: ``budgets`` one per rank (bytes); swap where
    ``config.swap``, recompute on ``recompute_stages``. Raises :class:`BudgetError` (a
    ValueError naming ``memory_budget``, each rank short of its budget and the least
    budget the planner meets there) when a budget is below what the planner reaches, and
    TypeError/ValueError for bad inputs. Equal arguments share one plan."""
    config, cost = _check_inputs(config, cost)
    budgets = _check_budgets(config, budgets)
    sizes = _stage_bytes(cost, config)
    plain = build_all_orders(replace(config, swap=False))
    planned: list[_RankPlanning] = []
    short: list[str] = []
    for rank, order in enumerate(plain):
        models, values = _chunk_models(config, rank, order, cost, sizes, recompute_stages)
        state, least = _plan_rank(models, values, budgets[rank])
        if state is None:
            short.append(f"rank {rank} needs at least {least} bytes (budget {budgets[rank]})")
            continue
        alternatives = _alternatives(models, values, state, budgets[rank])
        planned.append(_RankPlanning(models, state, alternatives, max(values, default=0), least))
    if short:
        raise BudgetError(
            f"memory_budget is below what keep/swap/recompute can reach: {'; '.join(short)}"
        )
    # Step 3: the candidate of least predicted step; each rank takes the candidate's
    # state where it has one within its budget, else its own plan's.
    names = ["plan", *dict.fromkeys(n for rank in planned for n in rank.alternatives)]
    best: tuple[float, tuple[Order, ...], list[_RankState]] | None = None
    seen: set[frozenset[tuple[Chunk, ChunkPolicy]]] = set()
    for name in names:
        states = [rank.alternatives.get(name, rank.state) for rank in planned]
        policies = {
            chunk: option.policy for state in states for chunk, option in state.chosen.items()
        }
        if frozenset(policies.items()) in seen:
            continue
        seen.add(frozenset(policies.items()))
        orders = orders_for_policies(config, policies)
        step_s = simulate_run(config, orders, cost).step_s
        if best is None or step_s < best[0]:
            best = (step_s, orders, states)
    assert best is not None
    step_s, orders, states = best
    validate_all(config, orders)
    ranks = [
        RankBudgetPlan(
            rank,
            budgets[rank],
            _policies_of(planning.models, state),
            state.peak(),
            planning.keep_peak,
            planning.least,
        )
        for rank, (planning, state) in enumerate(zip(planned, states, strict=True))
    ]
    return BudgetPlan(
        ranks=tuple(ranks),
        orders=orders,
        step_s=step_s,
        keep_step_s=simulate_run(config, plain, cost).step_s,
    )


def _policies_of(
    models: Sequence[_ChunkModel], state: _RankState
) -> tuple[tuple[Chunk, ChunkPolicy], ...]:
    return tuple(
        (model.chunk, state.chosen[model.chunk].policy if model.chunk in state.chosen else "keep")
        for model in sorted(models, key=lambda m: m.chunk)
    )


def least_budgets(
    config: ScheduleConfig, cost: CostModel, recompute_stages: frozenset[int] = frozenset()
) -> tuple[int, ...]:
    """Per rank, the least budget the planner meets (its peak with swap and recompute
    used as far as they lower it)."""
    config, cost = _check_inputs(config, cost)
    sizes = _stage_bytes(cost, config)
    plain = build_all_orders(replace(config, swap=False))
    least: list[int] = []
    for rank, order in enumerate(plain):
        models, values = _chunk_models(config, rank, order, cost, sizes, recompute_stages)
        least.append(_plan_rank(models, values, 0)[1])
    return tuple(least)
