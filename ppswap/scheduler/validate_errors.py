"""The errors of order validation: both are ValueErrors, so a caller that checks its
input catches them with its other refusals."""

from __future__ import annotations

__all__ = ["ScheduleDeadlockError", "ScheduleValidationError"]


class ScheduleValidationError(ValueError):
    """An order breaks an invariant of the schedule IR."""


class ScheduleDeadlockError(ScheduleValidationError):
    """The cross-rank simulation stopped with every unfinished rank blocked.

    ``stuck`` maps each blocked rank to the index of the step it waits at.
    """

    def __init__(self, message: str, stuck: dict[int, int]) -> None:
        super().__init__(message)
        self.stuck = stuck
