"""Errors and warnings of the swap runtime.

Every error is a :class:`SwapError` (a ``RuntimeError``), so a caller that only wants to
know "the swap layer refused" catches one type. The subclasses say why:

- :class:`SwapStateError`: an object was asked to move to a state it cannot reach from
  its current one (e.g. ``HOST -> DEVICE`` without a load, a second run of a copy job,
  a wait on an offload that never ran). The message always names the group, the tensor
  tag, the state the object was in and the state that was asked for.
- :class:`SwapTimeoutError`: a bounded wait (a copy job, a load the backward needs)
  outlived its timeout. Nothing in the swap layer waits without a timeout.

:class:`SwapWarning` is the category of the warnings the swap layer emits: the wrappers'
(for instance ``swap_tensor_wrapper`` called outside any collection context) and a run's
with ``swap=True`` that moved nothing because its stages marked nothing
(``ppswap.swap.unmarked``); filter it with
``warnings.filterwarnings("ignore", category=SwapWarning)``.
"""

from __future__ import annotations

import enum

__all__ = ["SwapError", "SwapStateError", "SwapTimeoutError", "SwapWarning"]


class SwapError(RuntimeError):
    """The swap runtime refused an operation or detected unsafe data."""


class SwapStateError(SwapError):
    """An illegal state transition of a swapped tensor, storage, group, job or session.

    ``from_state`` and ``to_state`` are :class:`~ppswap.swap.tensor.SwapState` members for
    tensor transitions and short words (``"ran"``, ``"running"``, ``"released"``...) for
    jobs and groups; both are kept as attributes for callers that inspect them.
    """

    def __init__(
        self,
        *,
        group: str,
        tag: str,
        from_state: enum.Enum | str,
        to_state: enum.Enum | str,
        detail: str = "",
    ) -> None:
        self.group = group
        self.tag = tag
        self.from_state = from_state
        self.to_state = to_state
        self.detail = detail
        message = (
            f"illegal swap transition in group {group!r}, tensor {tag!r}: "
            f"{_state_name(from_state)} -> {_state_name(to_state)}"
        )
        if detail:
            message = f"{message} ({detail})"
        super().__init__(message)


class SwapTimeoutError(SwapError):
    """A bounded wait of the swap runtime expired (a copy never finished)."""


class SwapWarning(UserWarning):
    """A swap request was ignored (no collection context is active), or a run with swap
    on moved nothing (its stages marked nothing)."""


def _state_name(state: enum.Enum | str) -> str:
    return state.name if isinstance(state, enum.Enum) else str(state)
