"""The batch of a run: its checks against the stages, before anything runs, and its
split into micro-batches, on the compute thread.

- ``inputs`` (first stage) and ``targets`` (last stage) are tensors of the stages'
  framework or numpy arrays of a numeric dtype, with a non-empty batch dimension divisible
  by ``micro_batch_num`` (times dp with FSDP), of the same batch size; floating ones have
  the floating dtype of their stage's parameters (frameworks do not promote: a float64
  batch into a float32 model fails in the first FWD); integer inputs (token ids) are free.
- ``inputs`` may also be a tuple of such (not a list: a nested list of numbers is the
  usual mistake, and is named as one), each split alike: the first stage's module is
  called with one micro-batch of each (``tokens, mask``); or a dict of such by keyword
  name, the module then called with them as keyword arguments (``input_ids=...,
  attention_mask=...``). ``targets`` may be a tuple too (``labels, loss_mask``):
  ``loss_fn`` then gets a tuple of one micro-batch of each.
- ``loss_fn``: a callable, required when the run has the last stage, but in a
  forward-only run: without one, that run returns the last stage's outputs
  (``RunResult.outputs``) and needs no targets. With a ``loss_fn`` the targets are
  required (``targets=None`` is refused as such).

Every refusal is a ``PipelineInputError`` (a TypeError for ``loss_fn``) that names the
parameter, the value and what is allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ppswap.backends.base import Backend
from ppswap.core.dtypes import is_bfloat16, is_floating
from ppswap.core.messages import HostArray
from ppswap.core.packed import MAX_ELEMENTS
from ppswap.errors import PipelineInputError
from ppswap.options import RunOptions
from ppswap.stage import LossFn, PipelineStage

__all__ = ["Batches", "check_data", "split_data"]


@dataclass(frozen=True, slots=True)
class Batches:
    """The micro-batches, as contiguous host arrays (index = micro-batch; a batch given as
    a tuple or dict of arrays: a tuple per micro-batch)."""

    inputs: list[HostArray] | list[tuple[HostArray, ...]]
    targets: list[HostArray] | list[tuple[HostArray, ...]] | None

    def of_replica(self, dp_index: int, micro: int) -> Batches:
        """The ``micro`` micro-batches of dp replica ``dp_index``: the batch is split into
        dp contiguous blocks, each block into micro-batches (replica-major order)."""
        low, high = dp_index * micro, (dp_index + 1) * micro
        targets = None if self.targets is None else self.targets[low:high]
        return Batches(self.inputs[low:high], targets)


def check_data(
    backend: Backend,
    stages: Sequence[PipelineStage],
    options: RunOptions,
    inputs: Any,
    targets: Any,
    loss_fn: LossFn | None,
    dp: int,
) -> None:
    """Refuse a batch, targets or ``loss_fn`` the stages of this process cannot run
    (module docstring); ``dp``: the data-parallel replicas the batch is split across."""
    micro = options.micro_batch_num
    by_index = {s.stage_index: s for s in stages}
    last_index = stages[0].stage_num - 1
    first, last = by_index.get(0), by_index.get(last_index)
    named_inputs = _named_parts("inputs", inputs, keywords=True)
    if first is not None:
        _check_parts(backend, "inputs", named_inputs, micro, dp)
        for name, part in named_inputs:
            _check_float_dtype(name, part, first, "first")
    inference = options.forward_only and loss_fn is None  # the last stage's outputs
    if last is not None and not inference:
        if loss_fn is None or not callable(loss_fn):
            raise TypeError(
                f"loss_fn must be a callable (output, target) -> scalar loss for the last "
                f"stage, got {loss_fn!r} (None only with forward_only=True: the run then "
                "returns the last stage's outputs)"
            )
        if targets is None:
            raise PipelineInputError(
                "targets must be given with loss_fn: the loss of a micro-batch is "
                "loss_fn(output, target), got targets=None (for the last stage's outputs "
                "instead, pass forward_only=True and no loss_fn)"
            )
        named_targets = _named_parts("targets", targets)
        _check_parts(backend, "targets", named_targets, micro, dp)
        for name, part in named_targets:
            _check_float_dtype(name, part, last, "last")
        if first is not None and named_targets[0][1].shape[0] != named_inputs[0][1].shape[0]:
            raise PipelineInputError(
                "inputs and targets must have the same batch size, got "
                f"{named_inputs[0][1].shape[0]} and {named_targets[0][1].shape[0]}"
            )


def _named_parts(name: str, value: Any, *, keywords: bool = False) -> list[tuple[str, Any]]:
    """A batch given as a tuple of parts (or, with ``keywords``, a dict of them by str
    key): each part with its name (``inputs[1]``, ``inputs['mask']``); else the batch
    itself."""
    if isinstance(value, tuple) or (keywords and isinstance(value, dict)):
        kind = "a tuple" if isinstance(value, tuple) else "a dict"
        if not 0 < len(value) <= MAX_ELEMENTS:
            raise PipelineInputError(
                f"{name} as {kind} must hold 1 to {MAX_ELEMENTS} parts, got {len(value)}"
            )
        if isinstance(value, tuple):
            return [(f"{name}[{index}]", part) for index, part in enumerate(value)]
        strays = [key for key in value if not isinstance(key, str) or not key.isidentifier()]
        if strays:
            raise PipelineInputError(
                f"{name} as a dict must have keyword names as keys (the first stage's module "
                f"is called with them), got {strays[0]!r}"
            )
        return [(f"{name}[{key!r}]", part) for key, part in value.items()]
    return [(name, value)]


def _check_parts(
    backend: Backend, name: str, named: list[tuple[str, Any]], micro: int, dp: int
) -> None:
    """The parts of ``name`` (``_named_parts``) checked one by one, and of one batch size."""
    for part_name, part in named:
        _check_batch(backend, part_name, part, micro, dp)
    sizes = {part.shape[0] for _, part in named}
    if len(sizes) > 1:
        found = ", ".join(f"{part_name} {part.shape[0]}" for part_name, part in named)
        raise PipelineInputError(f"every part of {name} must have one batch size, got {found}")


_NUMERIC_KINDS = "biuf"


def _check_batch(backend: Backend, name: str, value: Any, micro: int, dp: int) -> None:
    if not (isinstance(value, np.ndarray) or backend.is_tensor(value)):
        raise PipelineInputError(
            f"{name} must be a {backend.tensor_name} or numpy.ndarray, got {type(value).__name__}"
        )
    shape = tuple(value.shape)
    if len(shape) == 0:
        raise PipelineInputError(f"{name} must have a batch dimension, got a scalar")
    dtype = backend.numpy_dtype(value)
    if dtype is not None and dtype.kind not in _NUMERIC_KINDS and not is_bfloat16(dtype):
        raise PipelineInputError(
            f"{name} must hold numbers (bool, int or float), got dtype {dtype} (shape {shape})"
        )
    if shape[0] == 0:
        raise PipelineInputError(f"{name} must not be empty, got batch size 0 (shape {shape})")
    if shape[0] % (micro * dp) != 0:
        per_replica = f" x dp={dp} (the batch is split across dp replicas)" if dp > 1 else ""
        raise PipelineInputError(
            f"{name} batch size {shape[0]} (shape {shape}) must be divisible by "
            f"micro_batch_num={micro}{per_replica}"
        )


def _check_float_dtype(name: str, value: Any, stage: PipelineStage, which: str) -> None:
    """A floating batch (inputs for the first stage, targets for the last) must have the
    (single) floating dtype of that stage's parameters (frameworks do not promote)."""
    backend = stage.backend
    dtype = backend.numpy_dtype(value)
    if dtype is None or not is_floating(dtype):
        return
    param_dtypes = {backend.numpy_dtype(p) for p in stage.parameters}
    floating = {d for d in param_dtypes if d is not None and is_floating(d)}
    if len(floating) == 1 and dtype not in floating:
        (expected,) = floating
        raise PipelineInputError(
            f"{name} must have dtype {expected} (the {which} stage's parameters), got {dtype}: "
            f"convert the batch (e.g. {_conversion(backend, value, name, expected)})"
        )


def _conversion(backend: Backend, value: Any, name: str, dtype: np.dtype[Any]) -> str:
    """How to convert a batch to ``dtype`` in the batch's own framework."""
    if backend.name == "torch" and not isinstance(value, np.ndarray):
        return f"{name}.to(torch.{dtype})"
    return f"{name}.astype(np.{dtype})"


def split_data(backend: Backend, inputs: Any, targets: Any, parts: int) -> Batches:
    """``inputs`` and ``targets`` (None: none wanted) split into ``parts`` micro-batches
    along dim 0, each a contiguous host array, or a tuple of them for a batch given as a
    tuple or dict (a dict's parts in key order). Compute thread: it may read a framework
    tensor."""

    def split(value: Any) -> list[HostArray]:
        host = value if isinstance(value, np.ndarray) else backend.to_host(value, copy=False)
        return [np.array(part, copy=True, order="C") for part in np.split(host, parts, axis=0)]

    def split_parts(value: Any) -> list[HostArray] | list[tuple[HostArray, ...]]:
        if isinstance(value, tuple | dict):
            values = value if isinstance(value, tuple) else value.values()
            return list(zip(*(split(part) for part in values), strict=True))
        return split(value)

    return Batches(
        [] if inputs is None else split_parts(inputs),
        None if targets is None else split_parts(targets),
    )
