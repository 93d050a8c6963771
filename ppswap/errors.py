"""The errors a run can end with. All of them are ``PipelineError``s."""

from __future__ import annotations

__all__ = [
    "PipelineError",
    "PipelineHangError",
    "PipelineInputError",
    "first_pipeline_error",
    "named_failure",
]


class PipelineError(RuntimeError):
    """A run failed. Names the rank, the actor and the step where it happened.

    The original exception is the ``__cause__``.
    """

    def __init__(self, message: str, *, rank: int | None, actor: str | None, step: str | None):
        where = f"rank {rank}, actor {actor}, step {step}"
        super().__init__(f"[{where}] {message}")
        self.rank = rank
        self.actor = actor
        self.step = step


class PipelineHangError(PipelineError):
    """A wait outlived its deadline. ``dump`` is the flight recorder at that moment."""

    def __init__(
        self, message: str, *, rank: int | None, actor: str | None, step: str | None, dump: str
    ):
        super().__init__(f"{message}\n{dump}", rank=rank, actor=actor, step=step)
        self.dump = dump


def named_failure(
    error: BaseException, message: str, *, rank: int | None, actor: str, step: str | None
) -> PipelineError:
    """How every actor reports a failure: ``error`` itself when it already is a
    PipelineError (it names where it happened), else a PipelineError(``message``) naming
    this ``rank``, ``actor`` and ``step`` with ``error`` as its ``__cause__``."""
    if isinstance(error, PipelineError):
        return error
    named = PipelineError(message, rank=rank, actor=actor, step=step)
    named.__cause__ = error
    return named


class PipelineInputError(ValueError):
    """Bad input to a run, found before any work started."""


def _leaves(error: BaseException) -> list[BaseException]:
    if isinstance(error, BaseExceptionGroup):
        return [leaf for inner in error.exceptions for leaf in _leaves(inner)]
    return [error]


def first_pipeline_error(error: BaseException) -> BaseException:
    """The error a run should raise for ``error`` (often an ExceptionGroup of actors).

    Prefers the first PipelineError that is not a hang (a hang elsewhere is usually a
    consequence of it), then a hang, then any other exception, else ``error`` itself.
    """
    leaves = _leaves(error)
    for leaf in leaves:
        if isinstance(leaf, PipelineError) and not isinstance(leaf, PipelineHangError):
            return leaf
    for leaf in leaves:
        if isinstance(leaf, PipelineHangError):
            return leaf
    for leaf in leaves:
        if isinstance(leaf, Exception):
            return leaf
    return error
