"""Deprecated: MindSpore's forward-now-backward-later seam moved into the MindSpore backend
(``ppswap.backends.mindspore.autograd``, used through ``Backend.autograd``).

The old functions keep their signatures here, implemented on the backend's autograd.
Importing this module warns (``DeprecationWarning``) and imports MindSpore; it will be
removed in a later release.
"""

import warnings
from collections.abc import Callable, Sequence
from typing import Any

from ppswap.backends.mindspore.autograd import MindSporeAutograd, MindSporeRecord

__all__ = [
    "discard_all",
    "record_forward",
    "release_record",
    "run_backward",
    "run_without_graph",
]

warnings.warn(
    "ppswap.autograd moved to ppswap.backends.mindspore.autograd (Backend.autograd)",
    DeprecationWarning,
    stacklevel=2,
)

_AUTOGRAD = MindSporeAutograd()


def _record(fn: Callable[..., Any], inputs: Sequence[Any]) -> MindSporeRecord:
    # The executor finds a record by (fn, inputs); the output's shape matters to release.
    return MindSporeRecord(fn, tuple(inputs), (((), None),), False)


def record_forward(fn: Callable[..., Any], inputs: Sequence[Any]) -> Any:
    """Run ``fn(*inputs)`` recording its graph for a later ``run_backward``."""
    output, _ = _AUTOGRAD.record(fn, inputs)
    return output


def run_backward(
    fn: Callable[..., Any], inputs: Sequence[Any], weights: Sequence[Any], sensitivity: Any
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """Backward of the recorded ``fn(*inputs)``: ``(input_grads, weight_grads)``."""
    return _AUTOGRAD.backward(_record(fn, inputs), sensitivity, weights)


def release_record(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    weights: Sequence[Any],
    output_shape: tuple[int, ...],
    output_dtype: Any,
) -> bool:
    """Release an abandoned record (a zero-sensitivity backward); False if that failed."""
    record = MindSporeRecord(fn, tuple(inputs), ((tuple(output_shape), output_dtype),), False)
    return _AUTOGRAD.release(record, weights)


def run_without_graph(fn: Callable[..., Any], inputs: Sequence[Any]) -> Any:
    """Run ``fn(*inputs)`` with gradient recording off."""
    return _AUTOGRAD.run_without_graph(fn, inputs)


def discard_all() -> None:
    """Forget every recorded forward (and what its graph saved)."""
    _AUTOGRAD.discard_all()
