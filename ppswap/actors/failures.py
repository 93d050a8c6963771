"""StepFailures: how an actor names what went wrong.

Every error an actor raises names its rank, the actor and the step (``F1.0``, or a label
such as ``"fsdp finish"``); a missed deadline is a ``PipelineHangError`` that carries the
flight recorder's dump; any other exception becomes a ``PipelineError`` with the original
as its cause (a ``PipelineError`` stays itself: ``errors.named_failure``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio

from ppswap.actors.trace import FlightRecorder
from ppswap.core.messages import FutureTimeoutError
from ppswap.errors import PipelineError, PipelineHangError, named_failure
from ppswap.scheduler.steps import MetaStep

__all__ = ["StepFailures"]


def _label(step: MetaStep | str) -> str:
    return step.short() if isinstance(step, MetaStep) else step


@dataclass(frozen=True, slots=True)
class StepFailures:
    """The errors of actor ``actor`` of rank ``rank`` (module docstring)."""

    rank: int
    actor: str
    recorder: FlightRecorder

    def failure(self, step: MetaStep | str, message: str) -> PipelineError:
        """What the order or the run got wrong at ``step``."""
        return PipelineError(message, rank=self.rank, actor=self.actor, step=_label(step))

    def hang(self, step: MetaStep | str, message: str) -> PipelineHangError:
        """A deadline missed at ``step``, with the flight recorder's dump."""
        return PipelineHangError(
            message,
            rank=self.rank,
            actor=self.actor,
            step=_label(step),
            dump=self.recorder.dump(),
        )

    def named(self, step: MetaStep | str, error: Exception) -> PipelineError:
        """``error`` (raised at ``step``) as a PipelineError naming this actor."""
        message = f"{type(error).__name__}: {error}"
        return named_failure(error, message, rank=self.rank, actor=self.actor, step=_label(step))

    @contextmanager
    def naming(self, label: str) -> Iterator[None]:
        """Record ``label`` as a span; turn any failure inside into a PipelineError (or a
        PipelineHangError for a missed deadline) naming rank, actor and ``label``."""
        try:
            with self.recorder.span(self.rank, self.actor, label):
                yield
        except (PipelineError, anyio.get_cancelled_exc_class()):
            raise
        except FutureTimeoutError as exc:
            raise self.hang(label, str(exc)) from exc
        except Exception as exc:
            raise self.named(label, exc) from exc
