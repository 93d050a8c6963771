"""Batches: consecutive steps of a rank run as one job on the compute thread.

A hop to the compute thread and back costs tens of microseconds, about as much as the
bookkeeping of a swap step itself, so the compute actor hands over every run of
consecutive steps that are ready and need no other actor as *one* job: a FWD and the swap
launch that follows it, a swap wait whose copy is done and the BWD after it. The job runs
the steps' bodies in order and times each one on the thread; the first body that raises
ends the job, and the outcome says which step it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ppswap.scheduler.steps import MetaStep

__all__ = ["JOB_KINDS", "BatchOutcome", "StepJob", "run_batch"]

JOB_KINDS = (
    "forward",
    "backward",
    "backward_input",
    "backward_weight",
    "swap_prepare",
    "swap_finish",
)
"""The kinds of compute-thread work ``RankStats.compute_job_s`` is split by (what a
``CostModel``'s leaf and swap-step times are measured from)."""

SWAP_JOB_KINDS = frozenset({"swap_prepare", "swap_finish"})


@dataclass(frozen=True, slots=True)
class StepJob:
    """The compute-thread body of one step: ``run()`` (its result goes back to the loop)."""

    step: MetaStep
    kind: str
    run: Callable[[], Any]


@dataclass(frozen=True, slots=True)
class BatchOutcome:
    """What a batch did: per step that finished its result, start (``perf_counter``) and
    seconds; ``error`` is the exception of the step after the last one that finished."""

    results: list[Any]
    started: list[float]
    seconds: list[float]
    error: Exception | None


def run_batch(jobs: Sequence[StepJob]) -> BatchOutcome:
    """Compute thread: run ``jobs`` in order, stopping at the first that raises."""
    results: list[Any] = []
    started: list[float] = []
    seconds: list[float] = []
    clock = time.perf_counter
    for job in jobs:
        begin = clock()
        try:
            results.append(job.run())
        except Exception as exc:
            return BatchOutcome(results, started, seconds, exc)
        started.append(begin)
        seconds.append(clock() - begin)
    return BatchOutcome(results, started, seconds, None)
