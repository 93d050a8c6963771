"""Forward now, backward later, in any order: the torch autograd seam.

A forward is recorded by running it with grad mode on, on detached copies of its inputs
that require grad where they are floating and their dx is wanted (not the first stage's
input, nor the loss's target): torch keeps each
graph alive as long as its output is referenced, so the record is just the inputs and the
output, and backwards may run in any order. The backward is ``torch.autograd.grad`` of the
output seeded with the sensitivity, for the inputs that require grad and the weights: the
weights' ``.grad`` is never touched (the stage accumulates the gradients itself). An output
may be a tuple (several tensors between stages): its sensitivity is then a tuple too, and
the elements that require grad and got a gradient are the roots.

dx/dw split (``backward_input``): the first pass asks for the input gradients only and
keeps the graph (``retain_graph=True``); the returned callable runs the second pass, for
the weights, and frees the graph. The saved tensors therefore live until BWD_WEIGHT
(``defers_weight_grads``: the runtime releases the chunk's swap group after it).
``release`` of an abandoned record drops its output: the graph and what it saved go with
it. ``discard_all`` has nothing to do (torch keeps no process-wide record of graphs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ppswap.backends.autograd import ForwardRecord, WeightGrads

__all__ = ["TorchAutograd", "TorchRecord"]


Output = torch.Tensor | tuple[torch.Tensor, ...]
"""A forward's output: one tensor, or a tuple of them (several between stages)."""
Sensitivity = torch.Tensor | tuple[torch.Tensor | None, ...]
"""The gradient a backward is seeded with: one per output, None where an output got none."""


@dataclass(slots=True)
class TorchRecord:
    """A recorded forward: the inputs it ran on (those requiring grad give dx) and its
    output (the roots of the graph; dropping it frees the graph)."""

    inputs: tuple[torch.Tensor, ...]
    output: Output | None


def _live(record: ForwardRecord) -> tuple[TorchRecord, Output]:
    """The record and its output, which a backward has not consumed yet."""
    if not isinstance(record, TorchRecord):
        raise TypeError(f"expected a torch forward record, got {type(record).__name__}")
    if record.output is None:
        raise RuntimeError("the backward of this forward already ran (or it was released)")
    return record, record.output


def _roots(
    output: Output, sensitivity: Sensitivity
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs to differentiate and their seeds: those that require grad and got a
    gradient (each element of a tuple output with its own)."""
    if not isinstance(output, tuple):
        if not isinstance(sensitivity, torch.Tensor):
            raise TypeError(f"one output needs one gradient, got {type(sensitivity).__name__}")
        return ([output], [sensitivity]) if output.requires_grad else ([], [])
    if not isinstance(sensitivity, tuple) or len(sensitivity) != len(output):
        got = len(sensitivity) if isinstance(sensitivity, tuple) else "one"
        raise ValueError(f"{len(output)} outputs need {len(output)} gradients, got {got}")
    pairs = [(o, s) for o, s in zip(output, sensitivity, strict=True) if s is not None]
    kept = [(o, s) for o, s in pairs if o.requires_grad]
    return [o for o, _ in kept], [s for _, s in kept]


def _grad(
    output: Output,
    inputs: Sequence[torch.Tensor],
    sensitivity: Sensitivity,
    *,
    retain_graph: bool = False,
) -> tuple[torch.Tensor | None, ...]:
    """``torch.autograd.grad`` of ``output`` for ``inputs`` (None for an unused one), also
    when there is nothing to differentiate: no inputs (a stage without trainable
    parameters asked for dw, torch refuses an empty ``inputs``) or no output that requires
    grad and got a gradient (a frozen first stage; a tuple's integer mask)."""
    roots, seeds = _roots(output, sensitivity)
    if not inputs or not roots:
        return tuple(None for _ in inputs)
    grads: tuple[torch.Tensor | None, ...] = torch.autograd.grad(
        roots, list(inputs), seeds, retain_graph=retain_graph, allow_unused=True
    )
    return grads


def _grads_or_zeros(
    grads: Sequence[torch.Tensor | None], like: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, ...]:
    return tuple(
        g if g is not None else torch.zeros_like(t) for g, t in zip(grads, like, strict=True)
    )


@dataclass(slots=True)
class _PendingWeightGrads:
    record: TorchRecord
    sensitivity: Sensitivity
    weights: tuple[torch.Tensor, ...]

    def __call__(self) -> tuple[torch.Tensor, ...]:
        output = self.record.output
        if output is None:
            raise RuntimeError("the weight gradients of this forward were already computed")
        self.record.output = None
        weights = [w for w in self.weights if w.requires_grad]
        grads = _grad(output, weights, self.sensitivity)
        by_weight = dict(zip(map(id, weights), grads, strict=True))
        return _grads_or_zeros([by_weight.get(id(w)) for w in self.weights], self.weights)


class TorchAutograd:
    """The :class:`~ppswap.backends.base.Autograd` of torch."""

    defers_weight_grads = True

    def record(
        self,
        fn: Callable[..., Output],
        inputs: Sequence[torch.Tensor],
        grad_inputs: Sequence[bool] | None = None,
    ) -> tuple[Output, ForwardRecord]:
        """Run ``fn(*inputs)`` with grad mode on; floating inputs require grad, those that
        ``grad_inputs`` marks False excepted (their dx is never computed)."""
        wanted = [True] * len(inputs) if grad_inputs is None else list(grad_inputs)
        if len(wanted) != len(inputs):
            raise ValueError(f"grad_inputs has {len(wanted)} flags for {len(inputs)} inputs")
        leaves = tuple(
            t.detach().requires_grad_(want and (t.is_floating_point() or t.is_complex()))
            for t, want in zip(inputs, wanted, strict=True)
        )
        with torch.enable_grad():
            output = fn(*leaves)
        return output, TorchRecord(leaves, output)

    def backward(
        self,
        record: ForwardRecord,
        sensitivity: Sensitivity,
        weights: Sequence[torch.Tensor],
    ) -> tuple[tuple[torch.Tensor | None, ...], tuple[torch.Tensor, ...]]:
        """``(input_grads, weight_grads)``; an input without grad gets None."""
        rec, output = _live(record)
        rec.output = None
        wanted = [t for t in rec.inputs if t.requires_grad]
        trainable = [w for w in weights if w.requires_grad]
        grads = _grad(output, [*wanted, *trainable], sensitivity)
        by_tensor = dict(zip(map(id, [*wanted, *trainable]), grads, strict=True))
        input_grads = tuple(by_tensor.get(id(t)) if t.requires_grad else None for t in rec.inputs)
        weight_grads = _grads_or_zeros([by_tensor.get(id(w)) for w in weights], weights)
        return input_grads, weight_grads

    def backward_input(
        self,
        record: ForwardRecord,
        sensitivity: Sensitivity,
        weights: Sequence[torch.Tensor],
    ) -> tuple[tuple[torch.Tensor | None, ...], WeightGrads]:
        """dx now (the graph kept); dw when the returned callable runs (BWD_WEIGHT)."""
        rec, output = _live(record)
        wanted = [t for t in rec.inputs if t.requires_grad]
        input_grads: tuple[torch.Tensor | None, ...] = tuple(None for _ in rec.inputs)
        if wanted:
            grads = _grad(output, wanted, sensitivity, retain_graph=True)
            by_tensor = dict(zip(map(id, wanted), grads, strict=True))
            input_grads = tuple(by_tensor.get(id(t)) for t in rec.inputs)
        return input_grads, _PendingWeightGrads(rec, sensitivity, tuple(weights))

    def release(self, record: ForwardRecord, weights: Sequence[torch.Tensor]) -> bool:
        """Drop an abandoned record's output: its graph and saved tensors go with it."""
        if isinstance(record, TorchRecord):
            record.output = None
        return True

    def run_without_graph(
        self, fn: Callable[..., Output], inputs: Sequence[torch.Tensor]
    ) -> Output:
        with torch.no_grad():
            return fn(*inputs)

    def discard_all(self) -> None:
        return None
