"""Forward now, backward later, in any order: the MindSpore PyNative autograd seam.

Why not ``mindspore.vjp`` (measured on mindspore 2.10 CPU): ``vjp`` records each forward
as a "grad API first" top cell and bumps the executor's grad order once per outstanding
forward; a later ``vjp_fn`` looks its top cell up under the *current* grad order. With
several forwards outstanding, only the most recent one can run its backward: backwards
must come in LIFO order, and ``F0 F1 B0`` fails with "Can not find top cell for
backward". Every pipeline schedule needs FIFO (GPipe: ``F0..Fm B0..Bm``).

This module uses the executor calls ``vjp`` itself is built from, but the way
``net.set_grad(); net(x)`` records a forward: ``new_graph``/``end_graph`` restore the grad
order at the end of each forward, so every recorded forward is found later by
``(function, input tensors)``, in any order. The backward runs the same ``_Grad`` operation
``vjp`` uses (inputs and weights, with a sensitivity), so gradients are bit-identical to
``vjp``'s (``tests/backends/test_mindspore_autograd.py`` checks that).

Rules (the runtime's compute thread is the only caller):

- ``fn`` must be a plain Python function (MindSpore reads its ``__code__``), kept alive
  until the backward, and every input a Tensor kept alive until the backward: the record
  is keyed by their identities, and :class:`MindSporeRecord` holds both. Two outstanding
  records must differ in ``fn`` or inputs.
- dx/dw split: MindSpore's backward cannot compute the input gradient without the weight
  gradient, so ``backward_input`` computes both and keeps dw for the later BWD_WEIGHT: the
  *schedule* is ZB-H1's, the *compute* of dw is not deferred on this backend.
- ``discard_all`` drops every outstanding record (after a failed or cancelled run). A
  recorded forward whose backward never runs stays in the executor (measured: about 65 KB
  of process memory per abandoned record of a small MLP stage, never given back) until it
  runs. It is not needed for correctness: a later run's gradients are bit-identical with
  or without it.
- ``release`` gives back what an abandoned record holds. A record whose backward never
  runs keeps every value its saved-tensor hooks packed alive inside the executor, even
  after ``discard_all`` (measured: a 4-micro-batch MLP stage of width 256 leaked about
  6 MB per abandoned set; without hooks nothing leaks). Running the backward with a zero
  sensitivity releases them. A forward that raises inside ``record`` is closed there
  (``end_graph``); what its hooks packed must be handles that teardown can empty.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mindspore import Tensor, ops
from mindspore.graph.api import _no_grad, _pynative_executor
from mindspore.ops.composite.base import _Grad

from ppswap.backends.autograd import ForwardRecord, WeightGrads

__all__ = ["MindSporeAutograd", "MindSporeRecord"]

# Inputs and weights, with a sensitivity argument: exactly what mindspore.vjp builds.
_GRAD_OP = _Grad(get_all=True, get_by_list=True, sens_param=True, merge_forward=True)

Gradients = tuple[tuple[Tensor | None, ...], tuple[Tensor, ...]]


@dataclass(frozen=True, slots=True)
class MindSporeRecord:
    """The key of a recorded forward (``fn`` and the input tensors) and the shape and
    dtype of each output (zero sensitivities of those release an abandoned record, and
    stand in for an output of a tuple that got no gradient); ``tupled``: the output is a
    tuple (several tensors between stages)."""

    fn: Callable[..., Tensor]
    inputs: tuple[Tensor, ...]
    outputs: tuple[tuple[tuple[int, ...], Any], ...]
    tupled: bool

    def zeros(self, index: int) -> Tensor:
        shape, dtype = self.outputs[index]
        return ops.zeros(shape, dtype)

    def sensitivity(self, given: Tensor | tuple[Tensor | None, ...] | None) -> Any:
        """What the grad operation is seeded with: ``given`` (zeros where None), a tuple
        for a tuple output."""
        if not self.tupled:
            return self.zeros(0) if given is None else given
        if given is None:
            return tuple(self.zeros(i) for i in range(len(self.outputs)))
        if not isinstance(given, tuple) or len(given) != len(self.outputs):
            raise ValueError(f"{len(self.outputs)} outputs need as many gradients")
        return tuple(self.zeros(i) if g is None else g for i, g in enumerate(given))


@dataclass(frozen=True, slots=True)
class _KeptWeightGrads:
    grads: tuple[Tensor, ...]

    def __call__(self) -> tuple[Tensor, ...]:
        return self.grads


def _as_record(record: ForwardRecord) -> MindSporeRecord:
    if not isinstance(record, MindSporeRecord):
        raise TypeError(f"expected a MindSpore forward record, got {type(record).__name__}")
    return record


class MindSporeAutograd:
    """The :class:`~ppswap.backends.base.Autograd` of MindSpore PyNative."""

    defers_weight_grads = False

    def record(
        self,
        fn: Callable[..., Tensor],
        inputs: Sequence[Tensor],
        grad_inputs: Sequence[bool] | None = None,
    ) -> tuple[Tensor, ForwardRecord]:
        """Run ``fn(*inputs)`` recording its graph for a later backward. ``grad_inputs``
        is not used: MindSpore's grad operation returns every input's gradient."""
        args = tuple(inputs)
        _pynative_executor.set_grad_flag(True)
        _pynative_executor.new_graph(fn, *args)
        try:
            output = fn(*args)
        except BaseException:
            _pynative_executor.end_graph(fn, None, *args)
            raise
        _pynative_executor.end_graph(fn, output, *args)
        tupled = isinstance(output, tuple)
        elements = output if tupled else (output,)
        shapes = tuple((tuple(o.shape), o.dtype) for o in elements)
        return output, MindSporeRecord(fn, args, shapes, tupled)

    def backward(
        self,
        record: ForwardRecord,
        sensitivity: Tensor | tuple[Tensor | None, ...] | None,
        weights: Sequence[Tensor],
    ) -> Gradients:
        """``(input_grads, weight_grads)`` of the recorded forward (for a tuple output, a
        tuple of sensitivities, None where an output got no gradient). An input that is not
        floating (an integer mask) gets None, as on torch, not MindSpore's zeros."""
        rec = _as_record(record)
        input_grads, weight_grads = _pynative_executor.grad(
            rec.fn, _GRAD_OP, list(weights), None, False, *rec.inputs, rec.sensitivity(sensitivity)
        )
        grads = tuple(
            g if x.is_floating_point() else None
            for g, x in zip(input_grads, rec.inputs, strict=True)
        )
        return grads, tuple(weight_grads)

    def backward_input(
        self,
        record: ForwardRecord,
        sensitivity: Tensor | tuple[Tensor | None, ...] | None,
        weights: Sequence[Tensor],
    ) -> tuple[tuple[Tensor | None, ...], WeightGrads]:
        """dx now; dw computed in the same backward and kept (see the module doc)."""
        input_grads, weight_grads = self.backward(record, sensitivity, weights)
        return input_grads, _KeptWeightGrads(weight_grads)

    def release(self, record: ForwardRecord, weights: Sequence[Tensor]) -> bool:
        """Run the backward of an abandoned record with a zero sensitivity, dropping the
        result, so the executor lets go of its saved tensors; False if that failed."""
        rec = _as_record(record)
        try:
            self.backward(rec, None, weights)
        except Exception:
            return False
        return True

    def run_without_graph(self, fn: Callable[..., Tensor], inputs: Sequence[Tensor]) -> Tensor:
        """Run ``fn(*inputs)`` with gradient recording off: no graph, nothing saved."""
        with _no_grad():
            return fn(*inputs)

    def discard_all(self) -> None:
        """Forget every recorded forward (and what its graph saved)."""
        _pynative_executor.clear_res()
