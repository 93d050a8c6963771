"""The autograd seam: a stage's forward recorded now, its backward run later.

Part of the backend seam (``ppswap.backends.base``): a :class:`~ppswap.backends.base.Backend`
holds its framework's :class:`Autograd`, and the stage (``ppswap.stage``) drives it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

from ppswap.backends.types import Tensor

__all__ = ["Autograd", "ForwardRecord", "WeightGrads"]


class ForwardRecord(Protocol):
    """A stage forward recorded for a later backward (opaque; only the backend that made
    it reads it). It holds what the backward needs, not necessarily the output."""


class WeightGrads(Protocol):
    """The weight gradients of a split backward, computed now or when called."""

    def __call__(self) -> tuple[Tensor, ...]: ...


@runtime_checkable
class Autograd(Protocol):
    """Forward now, backward later, in any order (a pipeline's FWD and BWD steps).

    ``record`` runs ``fn(*inputs)`` recording its graph and returns its output (a tensor,
    or a tuple of them: several between stages) and the record; the saved-tensor hooks
    active around it see every tensor the graph saves.
    ``grad_inputs`` (default: every input) says which inputs' gradients a backward will
    ask for: a backend may skip the others' (the first stage's dx, the loss's target).
    ``backward`` runs the recorded graph's backward seeded with ``sensitivity`` (for a
    tuple output a tuple, None where an output got no gradient) and returns
    ``(input_grads, weight_grads)`` (None for an input that gets none, an integer one)
    (``weight_grads`` aligned with ``weights``). ``backward_input`` is the dx half of the
    dx/dw split: it returns the input gradients now and the weight gradients as a
    callable (a backend that cannot compute dx alone computes both and keeps dw).
    ``release`` gives back what an abandoned record holds (its backward never runs);
    ``run_without_graph`` runs a forward recording nothing (forward-only runs);
    ``discard_all`` forgets every record of the process (teardown of a failed run).
    """

    def record(
        self,
        fn: Callable[..., Tensor],
        inputs: Sequence[Tensor],
        grad_inputs: Sequence[bool] | None = None,
    ) -> tuple[Tensor, ForwardRecord]: ...

    def backward(
        self, record: ForwardRecord, sensitivity: Tensor, weights: Sequence[Tensor]
    ) -> tuple[tuple[Tensor | None, ...], tuple[Tensor, ...]]: ...

    def backward_input(
        self, record: ForwardRecord, sensitivity: Tensor, weights: Sequence[Tensor]
    ) -> tuple[tuple[Tensor | None, ...], WeightGrads]: ...

    def release(self, record: ForwardRecord, weights: Sequence[Tensor]) -> bool: ...

    def run_without_graph(self, fn: Callable[..., Tensor], inputs: Sequence[Tensor]) -> Tensor: ...

    def discard_all(self) -> None: ...

    @property
    def defers_weight_grads(self) -> bool:
        """Whether ``backward_input`` leaves the dw compute (and the graph's saved tensors)
        for later: then a chunk is released after its BWD_WEIGHT, not its BWD_INPUT."""
        ...
