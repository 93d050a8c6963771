"""What recomputing a block needs from torch: the forward's context, and a re-run under it.

A recompute-wrapped block of a recomputed chunk runs twice: at the chunk's FWD (its saved
tensors dropped) and at its RECOMPUTE step (``ppswap.swap.recompute``), which must save
the same tensors with the same values. ``forward_context`` takes, at the block's entry in
the FWD, what a re-run must reproduce: the default generators' states (the stage's own
stream, ``rng.py``, is installed around its forward, so these are the states the block
draws its dropout masks from) and the autocast settings. ``rerun_forward`` runs the block
again with grad mode on under those, every tensor the graph saves handed to ``pack``
detached (as ``torch.utils.checkpoint`` keeps its recomputed tensors), then puts the
generators back as they were: the stage's stream does not move.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["ForwardContext", "forward_context", "rerun_forward"]

_AUTOCAST_DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class ForwardContext:
    """The generator states (CPU; every initialized CUDA device's) and the autocast
    settings ``(device type, enabled, dtype)`` a block's forward ran with."""

    cpu_rng: torch.Tensor
    cuda_rng: tuple[torch.Tensor, ...]
    autocast: tuple[tuple[str, bool, torch.dtype], ...]


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def forward_context() -> ForwardContext:
    """The context a forward runs in now (module docstring)."""
    cuda = tuple(torch.cuda.get_rng_state_all()) if _cuda_ready() else ()
    autocast = tuple(
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        for device in _AUTOCAST_DEVICES
    )
    return ForwardContext(torch.get_rng_state(), cuda, autocast)


def _saving(pack: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(tensor: torch.Tensor) -> torch.Tensor:
        kept = tensor.detach()
        pack(kept)
        # Not ``tensor``: a saved output holds its own grad_fn, a cycle through the C++
        # graph that the garbage collector cannot see; the re-run's graph (and every
        # tensor it saved) would then outlive the step.
        return kept

    return hook


def _unpacked(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def rerun_forward(
    call: Callable[[], Any], context: object, pack: Callable[[torch.Tensor], None]
) -> None:
    """Run ``call()`` again under ``context`` (a :class:`ForwardContext`) with grad mode
    on, each saved tensor handed to ``pack`` in the order the graph saves them; the output
    and its graph are dropped; the generators are as they were before, after."""
    if not isinstance(context, ForwardContext):
        raise TypeError(f"expected a torch ForwardContext, got {type(context).__name__}")
    outer_cpu = torch.get_rng_state()
    outer_cuda = torch.cuda.get_rng_state_all() if context.cuda_rng else None
    torch.set_rng_state(context.cpu_rng)
    if context.cuda_rng:
        torch.cuda.set_rng_state_all(list(context.cuda_rng))
    try:
        with ExitStack() as scopes:
            for device, enabled, dtype in context.autocast:
                scopes.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled))
            scopes.enter_context(torch.enable_grad())
            scopes.enter_context(torch.autograd.graph.saved_tensors_hooks(_saving(pack), _unpacked))
            call()
    finally:
        torch.set_rng_state(outer_cpu)
        if outer_cuda is not None:
            torch.cuda.set_rng_state_all(outer_cuda)
