"""The trace spans of one rank's compute batches.

Each step of a batch is drawn as the compute thread timed it (``BatchOutcome``), and a
receive or send posted ahead of the batch in the gap after the step it follows in the
order (``FlightRecorder.add_batch_spans``). A composite (OVERLAP_B_F) whose two leaves ran
as jobs of a batch, possibly of two batches where the first yielded the thread, is drawn
around them once both ran: from the first leaf's start to the last one's end. Only where
the recorder keeps spans (``trace=``); otherwise every call returns at once.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppswap.actors.batch import BatchOutcome
from ppswap.actors.trace import ROUNDING_MARGIN_S, FlightRecorder
from ppswap.scheduler.steps import MetaStep

__all__ = ["BatchTrace"]


class BatchTrace:
    """The spans of ``rank``'s batches on ``actor``'s lane of ``recorder``."""

    def __init__(self, recorder: FlightRecorder, rank: int, actor: str) -> None:
        self._recorder = recorder
        self._rank = rank
        self._actor = actor
        # The leaves of composites in batches: (start, seconds) once each ran.
        self._leaves: dict[MetaStep, tuple[float, float] | None] = {}

    def expect_composites(self, composites: Sequence[MetaStep]) -> None:
        """The leaves of ``composites`` are jobs of the batch about to run."""
        if self._recorder.keeps_spans:
            self._leaves.update((leaf, None) for c in composites for leaf in c.sub_steps)

    def batch(
        self,
        steps: Sequence[MetaStep],
        outcome: BatchOutcome,
        posted: Sequence[tuple[int, MetaStep]],
    ) -> None:
        """The spans of the ``steps`` a batch ran (``posted``: as ``add_batch_spans``)."""
        if not self._recorder.keeps_spans:
            return
        self._recorder.add_batch_spans(
            self._rank, self._actor, steps, outcome.started, outcome.seconds, posted
        )
        leaves = self._leaves
        if leaves:
            for step, started, seconds in zip(steps, outcome.started, outcome.seconds, strict=True):
                if step in leaves:
                    leaves[step] = (started, seconds)

    def composites_done(self, composites: Sequence[MetaStep]) -> None:
        """The span of each of ``composites``, whose leaves ran in batches."""
        if not self._recorder.keeps_spans:
            return
        for composite in composites:
            times = [self._leaves.pop(leaf, None) for leaf in composite.sub_steps]
            ran = [t for t in times if t is not None]
            if len(ran) < len(times):
                continue
            start = min(started for started, _ in ran) - ROUNDING_MARGIN_S
            end = max(started + seconds for started, seconds in ran) + ROUNDING_MARGIN_S
            self._recorder.add_timed_span(
                self._rank, self._actor, composite.short(), start, end - start
            )
