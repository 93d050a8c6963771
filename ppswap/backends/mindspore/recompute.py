"""What recomputing a block needs from MindSpore PyNative: the forward's generator state,
and a re-run under it.

``forward_context`` is the default generator's state at the block's entry in the FWD
(what ``mint`` dropout draws from; ``nn.Dropout``'s ``ops.Dropout`` keeps per-operator
states no generator state restores). ``rerun_forward`` runs the block again the way
MindSpore's own non-reentrant recompute does (``mindspore.common.recompute``): grad
recording on, inside an empty top graph (``new_empty_graph`` / ``end_empty_graph``: the
re-run joins no recorded forward and none waits for its backward), each saved tensor
handed to ``pack`` through ``saved_tensors_hooks``, cut from the re-run's graph
(``ops.stop_gradient``); the generator state is put back after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mindspore import Tensor, ops
from mindspore.common.generator import get_rng_state, set_rng_state
from mindspore.graph.api import _pynative_executor, saved_tensors_hooks

__all__ = ["forward_context", "rerun_forward"]


def forward_context() -> object:
    """The default generator's state now."""
    state: object = get_rng_state()
    return state


def _saving(pack: Callable[[Tensor], None]) -> Callable[[Tensor], Tensor]:
    def hook(tensor: Tensor) -> Tensor:
        kept: Tensor = ops.stop_gradient(tensor)
        pack(kept)
        # Not ``tensor``: a saved output held as is keeps the re-run's graph alive in a
        # cycle the garbage collector cannot see, with every tensor it saved.
        return kept

    return hook


def _unpacked(tensor: Tensor) -> Tensor:
    return tensor


def rerun_forward(call: Callable[[], Any], context: object, pack: Callable[[Tensor], None]) -> None:
    """Run ``call()`` again from the generator state ``context`` (module docstring)."""
    outer = get_rng_state()
    grad_flag = _pynative_executor.grad_flag()
    enable_grad = _pynative_executor.enable_grad()
    set_rng_state(context)
    _pynative_executor.set_grad_flag(True)
    _pynative_executor.set_enable_grad(True)
    try:
        with saved_tensors_hooks(_saving(pack), _unpacked):
            _pynative_executor.new_empty_graph()
            try:
                call()
            finally:
                _pynative_executor.end_empty_graph()
    finally:
        _pynative_executor.set_grad_flag(grad_flag)
        _pynative_executor.set_enable_grad(enable_grad)
        set_rng_state(outer)
