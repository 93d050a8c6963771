"""The cost policy's memory model: a rank's peak under a chunk selection, without re-planning.

The memory model is ``simulate.memory_profile`` (resident chunks at every top-level step;
a split chunk released where ``config.saved_until`` says). Two facts about it make a
selection's peak cheap to update:

- The peak is reached at a compute slot. Between two compute slots the swap steps only
  release (SWAP_WAIT_OFFLOAD) and then re-allocate (SWAP_LAUNCH_LOAD: every offload wait
  of a block sits before the block's loads), so no step of a gap holds more than the slot
  before it or the slot after it.
- A swapped chunk lowers the value of exactly the compute slots of its *window* by one:
  from slot ``fwd_slot + 2`` (its offload is waited before that slot) up to, not
  including, the first slot after its SWAP_LAUNCH_LOAD. The load's point depends only on
  the chunk and the swap-free order, not on which other chunks move, so the window is
  read once from the fixed rule's order.

:class:`RankMemory` holds a rank's values at its compute slots under a selection, with
prefix counts of the slots at the peak and one below it: the (peak, slots at the peak) of
the selection with one chunk more or one chunk less is then O(1), and applying a change
is linear in the slots.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ppswap.scheduler.analysis import compute_slots
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.simulate import memory_profile
from ppswap.scheduler.steps import Order, StepKind
from ppswap.scheduler.swap_plan import inject_swap_steps, plan_swap

__all__ = ["Candidate", "RankMemory", "candidates_of"]

Chunk = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Candidate:
    """A chunk the cost policy may swap: one of the fixed rule's chunks of ``rank``.

    ``gap`` and ``fwd_slot`` are the swap plan's; the chunk is off device over the compute
    slots ``start .. end - 1`` (its window; empty when ``end == start``).
    """

    rank: int
    chunk: Chunk
    gap: int
    fwd_slot: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Resident chunks of one rank at each compute slot under a selection (``values``),
    its ``peak`` and ``count`` (slots at the peak); ``at_peak`` and ``below_peak`` are
    prefix counts of the slots at ``peak`` and at ``peak - 1``. Build with :meth:`of`."""

    values: tuple[int, ...]
    peak: int
    count: int
    at_peak: tuple[int, ...]
    below_peak: tuple[int, ...]

    @classmethod
    def of(cls, values: Sequence[int]) -> RankMemory:
        peak = max(values, default=0)
        at_peak = [0]
        below_peak = [0]
        at = below = 0
        for value in values:
            if value == peak:
                at += 1
            elif value == peak - 1:
                below += 1
            at_peak.append(at)
            below_peak.append(below)
        return cls(tuple(values), peak, at, tuple(at_peak), tuple(below_peak))

    def with_chunk(self, candidate: Candidate) -> tuple[int, int]:
        """(peak, slots at it) once ``candidate`` is also swapped (its window drops by one)."""
        start, end = candidate.start, candidate.end
        covered = self.at_peak[end] - self.at_peak[start]
        if covered < self.count:
            return (self.peak, self.count - covered)
        below_outside = self.below_peak[-1] - (self.below_peak[end] - self.below_peak[start])
        return (self.peak - 1, self.count + below_outside)

    def without_chunk(self, candidate: Candidate) -> tuple[int, int]:
        """(peak, slots at it) once ``candidate`` stays on device (its window rises by one)."""
        start, end = candidate.start, candidate.end
        raised = self.at_peak[end] - self.at_peak[start]
        if raised:
            return (self.peak + 1, raised)
        return (self.peak, self.count + self.below_peak[end] - self.below_peak[start])

    def changed(self, candidate: Candidate, delta: int) -> RankMemory:
        """The memory with ``delta`` (-1: swapped, +1: kept) added over the window."""
        return self.changed_by((candidate,), delta)

    def changed_by(self, candidates: Iterable[Candidate], delta: int) -> RankMemory:
        """The memory with ``delta`` added over the window of every one of ``candidates``."""
        values = list(self.values)
        for candidate in candidates:
            for slot in range(candidate.start, candidate.end):
                values[slot] += delta
        return RankMemory.of(values)


def candidates_of(
    config: ScheduleConfig, rank: int, order: Order
) -> tuple[list[Candidate], RankMemory]:
    """The fixed rule's chunks of rank ``rank`` (``order`` swap-free, ``config.swap``
    True) with their windows, in FWD order, and the rank's memory with none swapped
    (a split chunk held until ``config.saved_until``'s step: a window still ends at the
    load before the BWD_INPUT, since the chunk is back on device from there)."""
    plans = [plan for plan in plan_swap(order, config) if plan.eligible]
    end: dict[Chunk, int] = {}
    slots = 0
    for step in inject_swap_steps(order, config, rank):
        if step.is_compute:
            slots += 1
        elif step.kind is StepKind.SWAP_LAUNCH_LOAD:
            end[step.chunk] = slots
    profile = memory_profile(order, saved_until=config.saved_until)
    base = RankMemory.of([profile[slot.index] for slot in compute_slots(order)])
    candidates = [
        Candidate(rank, plan.chunk, plan.gap, plan.fwd_slot, plan.fwd_slot + 2, end[plan.chunk])
        for plan in plans
    ]
    return candidates, base
