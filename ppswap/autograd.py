"""Forward now, backward later, in any order: the MindSpore PyNative autograd seam.

Why not ``mindspore.vjp`` (a deliberate deviation from DESIGN.md §5, measured on
mindspore 2.10 CPU): ``vjp`` records each forward as a "grad API first" top cell and bumps
the executor's grad order once per outstanding forward; a later ``vjp_fn`` looks its top
cell up under the *current* grad order. With several forwards outstanding, only the most
recent one can run its backward: backwards must come in LIFO order, and
``F0 F1 B0`` fails with "Can not find top cell for backward". Every pipeline schedule
needs FIFO (GPipe: ``F0..Fm B0..Bm``).

This module uses the executor calls ``vjp`` itself is built from, but the way
``net.set_grad(); net(x)`` records a forward: ``new_graph``/``end_graph`` restore the grad
order at the end of each forward, so every recorded forward is found later by
``(function, input tensors)``, in any order. The backward runs the same ``_Grad`` operation
``vjp`` uses (inputs and weights, with a sensitivity), so gradients are bit-identical to
``vjp``'s (tests/runtime/test_autograd.py checks that).

Rules for callers (the runtime's compute thread is the only caller):

- ``fn`` must be a plain Python function (MindSpore reads its ``__code__``), kept alive
  until the backward, and every input a Tensor kept alive until the backward: the record
  is keyed by their identities. Two outstanding records must differ in ``fn`` or inputs.
- Saved-tensor hooks active around ``record_forward`` see every tensor the graph saves.
- ``discard_all`` drops every outstanding record (after a failed or cancelled run). It is
  needed: a recorded forward whose backward never runs stays in the executor (measured
  here: about 65 KB of process memory per abandoned record of a small MLP stage, never
  given back), and ``discard_all`` returns it. It is not needed for correctness: a later
  run's gradients are bit-identical with or without it (tests/reliability checks both).
  A forward that raises inside ``record_forward`` is closed there (``end_graph``) and
  leaves nothing behind.
- ``release_record`` gives back what an abandoned record holds. A record whose backward
  never runs keeps every value its saved-tensor hooks packed alive inside the executor,
  even after ``discard_all`` (measured: a 4-micro-batch MLP stage of width 256 leaked
  about 6 MB per abandoned set; without hooks nothing leaks). Running the backward with
  a zero sensitivity releases them (measured: no growth). A forward that raises inside
  ``record_forward`` while hooks are active leaks the same way and has no output to run
  a backward from: that leak (one chunk per such failure) needs the packed values to be
  handles that teardown can empty (see docs/reliability.md).
- ``run_without_graph`` runs a forward with gradient recording off (forward-only runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from mindspore import Tensor, ops
from mindspore.graph.api import _no_grad, _pynative_executor
from mindspore.ops.composite.base import _Grad

__all__ = [
    "Gradients",
    "discard_all",
    "record_forward",
    "release_record",
    "run_backward",
    "run_without_graph",
]

Gradients = tuple[tuple[Tensor, ...], tuple[Tensor, ...]]

# Inputs and weights, with a sensitivity argument: exactly what mindspore.vjp builds.
_GRAD_OP = _Grad(get_all=True, get_by_list=True, sens_param=True, merge_forward=True)


def record_forward(fn: Callable[..., Tensor], inputs: Sequence[Tensor]) -> Tensor:
    """Run ``fn(*inputs)`` recording its graph for a later ``run_backward``."""
    _pynative_executor.set_grad_flag(True)
    _pynative_executor.new_graph(fn, *inputs)
    try:
        output = fn(*inputs)
    except BaseException:
        _pynative_executor.end_graph(fn, None, *inputs)
        raise
    _pynative_executor.end_graph(fn, output, *inputs)
    return output


def run_backward(
    fn: Callable[..., Tensor],
    inputs: Sequence[Tensor],
    weights: Sequence[Any],
    sensitivity: Tensor,
) -> Gradients:
    """Backward of the recorded ``fn(*inputs)``: ``(input_grads, weight_grads)``."""
    input_grads, weight_grads = _pynative_executor.grad(
        fn, _GRAD_OP, list(weights), None, False, *inputs, sensitivity
    )
    return tuple(input_grads), tuple(weight_grads)


def release_record(
    fn: Callable[..., Tensor],
    inputs: Sequence[Tensor],
    weights: Sequence[Any],
    output_shape: tuple[int, ...],
    output_dtype: Any,
) -> bool:
    """Run the backward of an abandoned record with a zero sensitivity, dropping the
    result, so the executor lets go of its saved tensors; False if that backward failed."""
    try:
        sensitivity = ops.zeros(output_shape, output_dtype)
        run_backward(fn, inputs, weights, sensitivity)
    except Exception:
        return False
    return True


def run_without_graph(fn: Callable[..., Tensor], inputs: Sequence[Tensor]) -> Tensor:
    """Run ``fn(*inputs)`` with gradient recording off: no graph, nothing saved."""
    with _no_grad():
        return fn(*inputs)


def discard_all() -> None:
    """Forget every recorded forward (and what its graph saved)."""
    _pynative_executor.clear_res()
