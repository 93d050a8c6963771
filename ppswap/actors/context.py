"""RunContext: what every actor of one rank knows about the run it belongs to.

One frozen object per rank and run, made by ``RankRuntime`` and handed to the rank's
actors (compute, P2P) and its FSDP driver instead of a parameter each: the rank, the
run's generation, the step deadline (``RunOptions.step_timeout``, the only default of
it), the flight recorder, the fault plan (None in production) and whether steps are
logged. Nothing in it changes during the run; per-run mutable state lives with the
actor that owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

from ppswap.actors.trace import FlightRecorder
from ppswap.core.faults import FaultPlan
from ppswap.events import RunEvents

__all__ = ["RunContext"]


@dataclass(frozen=True, slots=True)
class RunContext:
    """One rank's view of its run (module docstring). ``step_timeout_s`` bounds every
    wait of a step; ``log_steps``: log a structlog event per step (the application
    configured structlog)."""

    rank: int
    generation: int
    step_timeout_s: float
    recorder: FlightRecorder
    faults: FaultPlan | None = None
    log_steps: bool = False
    events: RunEvents | None = None  # progress events (ppswap.events), emitted on the loop

    def logger(self, actor: str) -> Any:
        """The structlog logger of ``actor`` on this rank."""
        return structlog.get_logger("ppswap").bind(rank=self.rank, actor=actor)
