"""The torch modules and parameters the backend makes or changes: the swap and recompute
wrappers, and the parameter data FSDP installs (its unshard and reshard).

A graph keeps views of the tensors it saved, parameters' included, whatever later
becomes of ``param.data``: ``install_parameter_data`` therefore refills one kept storage
per unsharded shape and frees it by resizing it to 0 bytes, so resharding really frees
the full parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ppswap.backends.torch.host_arrays import tensor_of
from ppswap.backends.types import HostArray

__all__ = ["RecomputeWrapperModule", "SwapWrapperModule", "install_parameter_data"]

_SLOTS_ATTR = "_ppswap_data_slots"


class SwapWrapperModule(nn.Module):
    """``swap_wrapper(module)``: a module whose forward runs the wrapped module's through
    ``run`` (the swap layer's capture). Its parameters are the wrapped module's, in the
    same order; their names gain the ``module.`` prefix."""

    def __init__(self, module: nn.Module, run: Callable[[Callable[[], Any]], Any]) -> None:
        super().__init__()
        self.module = module
        self.swap_run = run

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.swap_run(lambda: self.module(*args, **kwargs))


class RecomputeWrapperModule(nn.Module):
    """``recompute_wrapper(module)``: a module whose forward hands the wrapped module and
    its arguments to ``region`` (``ppswap.swap.recompute``). Its parameters are the
    wrapped module's, in the same order; their names gain the ``module.`` prefix."""

    def __init__(
        self, module: nn.Module, region: Callable[[nn.Module, tuple[Any, ...], dict[str, Any]], Any]
    ) -> None:
        super().__init__()
        self.module = module
        self.recompute_region = region

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.recompute_region(self.module, args, kwargs)


def install_parameter_data(param: torch.Tensor, data: HostArray) -> None:
    """Replace ``param``'s data with a copy of ``data``; an install that grows the
    parameter (FSDP's unshard) goes into a storage ``param`` keeps for that shape,
    whose bytes the next shrinking install (the reshard) frees.

    The graph of a recorded forward keeps views of the full tensor (``nn.Linear``
    saves ``weight.t()``), so with a fresh full storage per unshard that storage would
    stay alive, whole, until every backward of that unshard ran: resharding would
    free nothing and each unshard would add a full copy. With the kept storage,
    resharding resizes it to 0 bytes (the saved views then hold a 0-byte storage) and
    the next unshard refills that same storage before any backward reads it (what
    torch's own FSDP does). A storage torch will not resize (a numpy array was made
    from it) is left to the graph as before, never an error.
    """
    source = tensor_of(data if data.flags.writeable else data.copy())
    slots: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor] | None = getattr(
        param, _SLOTS_ATTR, None
    )
    if slots is None:
        slots = {}
        setattr(param, _SLOTS_ATTR, slots)
    if source.numel() > param.data.numel():
        key = (tuple(source.shape), source.dtype)
        slot = slots.get(key)
        if slot is None:
            slot = torch.empty(key[0], dtype=source.dtype, device=param.device)
            slots[key] = slot
        else:
            slot.untyped_storage().resize_(slot.numel() * slot.element_size())
        with torch.no_grad():
            slot.copy_(source)
        installed = slot
    else:
        installed = source.to(param.device, copy=True)
    param.data = installed
    for key, other in list(slots.items()):
        if other is installed:
            continue
        storage = other.untyped_storage()
        if storage.resizable():
            storage.resize_(0)
        else:
            del slots[key]


# -- tensors ----------------------------------------------------------------------
