"""The peak policy, ``swap_policy="peak"``: the gap rule's peak with the fewest copies.

The fixed rule (``swap_policy="gap"``, the default: the gap rule) swaps every chunk whose gap
is at least ``min_swap_gap``. A rank's peak of resident chunks, the memory that runs out,
is lowered only where *every* compute slot at the peak is covered by some swapped chunk's
window (``cost_memory``: a swapped chunk is off device over the compute slots from the
second after its FWD to the one its SWAP_LAUNCH_LOAD precedes). Many of the rule's chunks
are off device only where the profile is already below the peak: their copies spend
copy-stream time, host memory and the compute thread's swap steps, and lower no peak.
1F1B pp4 m16 is the extreme: rank 1 swaps 14 chunks and its peak stays at 3.

This policy keeps, per rank, a smallest-found subset of the fixed rule's chunks whose peak
equals the fixed rule's peak, placed by the same anchors (``inject_swap_steps`` with
``chunks=``): it moves no bytes that do not lower a peak and never more than the rule.

Selection, per rank (ranks do not interact: a rank's memory depends on its own order):

1. Greedy, from no chunk: while some remaining candidate lowers the profile (its peak,
   or the number of compute slots at it: a window that covers a peak slot), add the one
   that leaves the lowest (peak, slots at the peak), then the longest gap (its copies the
   best hidden), then the earliest FWD. It stops at the fixed rule's peak: a candidate
   that covers no peak slot lowers nothing, and once no candidate covers one, adding all
   the rest would not lower the peak either.
2. Pruned, last chosen first: a chunk whose removal leaves the peak where it is goes.

Peaks are in resident chunks, the model of ``simulate.memory_profile`` that the gap rule's
predictions use (a split chunk held until ``config.saved_until``'s step); chunks of one
rank are taken as equal in size (on the last stage the loss adds to its chunks). Below
its peak a rank holds more chunks than under the fixed rule, so
what else the device holds at those moments (gradients, a backward's temporaries) meets
more activations than before: the fixed rule stays the default for that reason, and
because the published memory figures are its.

Nothing here imports MindSpore or anyio; every function is pure.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_memory import Candidate, RankMemory, candidates_of
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.steps import Order
from ppswap.scheduler.swap_plan import inject_swap_steps

__all__ = ["build_peak_orders", "peak_chunks"]

Chunk = tuple[int, int]


def _rank_selection(candidates: Sequence[Candidate], base: RankMemory) -> frozenset[Chunk]:
    """The chunks of one rank: the greedy, then the pruning (module docstring)."""
    memory = base
    remaining = list(candidates)
    chosen: list[Candidate] = []
    while True:
        best: tuple[tuple[int, int, int, int], Candidate] | None = None
        for candidate in remaining:
            peak, count = memory.with_chunk(candidate)
            if (peak, count) >= (memory.peak, memory.count):
                continue
            key = (peak, count, -candidate.gap, candidate.fwd_slot)
            if best is None or key < best[0]:
                best = (key, candidate)
        if best is None:
            break
        picked = best[1]
        remaining.remove(picked)
        chosen.append(picked)
        memory = memory.changed(picked, -1)
    for candidate in reversed(chosen):
        if memory.without_chunk(candidate)[0] == memory.peak:
            memory = memory.changed(candidate, +1)
            chosen.remove(candidate)
    return frozenset(candidate.chunk for candidate in chosen)


def peak_chunks(config: ScheduleConfig, plain: Sequence[Order]) -> tuple[frozenset[Chunk], ...]:
    """Per rank, the chunks the peak policy swaps, from the swap-free orders ``plain``
    (one per rank); ``config.swap`` is treated as True."""
    config = replace(config, swap=True)
    selections = []
    for rank, order in enumerate(plain):
        candidates, base = candidates_of(config, rank, order)
        selections.append(_rank_selection(candidates, base))
    return tuple(selections)


def build_peak_orders(config: ScheduleConfig) -> tuple[Order, ...]:
    """Every rank's finalized order with the peak policy's swap steps (the plain orders
    when ``config.swap`` is False)."""
    if not isinstance(config, ScheduleConfig):
        raise TypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    if not config.swap:
        return build_all_orders(config)
    plain = build_all_orders(replace(config, swap=False))
    chosen = frozenset().union(*peak_chunks(config, plain))
    return tuple(
        inject_swap_steps(order, config, rank, chunks=chosen) for rank, order in enumerate(plain)
    )
