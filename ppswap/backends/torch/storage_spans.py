"""A storage's used bytes as one span, and the saved views rebuilt on a restored span.

Saved tensors can be views sharing one storage (q, k and v of an ``unbind``, ``k``
transposed, a 4-D ``matmul``'s operand as it is and reshaped), at offsets and with any
strides. The swap layer moves a storage's used bytes once (``storage_bytes``,
``host_bytes``) and rebuilds every view on the restored span with ``set_``
(``views_of``, ``host_views``): the views share one storage again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch

from ppswap.backends.base import ViewKey
from ppswap.backends.torch.host_arrays import (
    c_strides,
    dtype_named,
    numpy_dtype_of,
    numpy_of,
    tensor_of,
)
from ppswap.backends.types import HostArray

__all__ = ["host_bytes", "host_views", "storage_bytes", "views_of"]


def storage_bytes(tensor: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
    """Bytes ``start`` to ``start + nbytes`` of ``tensor``'s storage, as a uint8 tensor on
    its device sharing that storage."""
    span = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    return span.set_(tensor.untyped_storage(), start, (nbytes,), (1,))


def host_bytes(tensor: torch.Tensor, start: int, nbytes: int) -> HostArray | None:
    """``storage_bytes`` as a host array sharing the memory, for a CPU tensor; None for
    any other device's."""
    if not tensor.is_cpu:
        return None
    # Once per span when a forward ends. A C-contiguous tensor whose bytes are the span
    # (the common case: one saved view per storage) is read through its own numpy
    # view, which keeps the tensor alive; any other span through a uint8 tensor set_
    # onto the storage. numpy() refuses a lazily conjugated or negated view (the swap
    # layer never captures one, is_lazy_view; its raw bytes are still readable here).
    itemsize = tensor.element_size()
    if (
        tensor.storage_offset() * itemsize == start
        and tensor.numel() * itemsize == nbytes
        and numpy_dtype_of(tensor.dtype) is not None
        and not (tensor.is_conj() or tensor.is_neg())
    ):
        elements = numpy_of(tensor, detach=True)
        if elements.flags.c_contiguous:  # so reshape(-1) is a view, never a copy
            dense: HostArray = elements.reshape(-1).view(np.uint8)
            return dense
    return numpy_of(storage_bytes(tensor, start, nbytes))


def host_views(block: HostArray, places: Sequence[tuple[int, ViewKey]]) -> list[torch.Tensor]:
    """``views_of`` a host block: tensors sharing ``block``'s memory."""
    if len(places) == 1:
        # One C-contiguous view filling the block from its first byte (the common
        # case, and the span is then exactly its bytes): the block's memory as that
        # view, through numpy, without a torch op per view.
        ((offset, key),) = places
        dtype = numpy_dtype_of(dtype_named(key.dtype))
        if (
            offset == 0
            and dtype is not None
            and math.prod(key.shape) * key.itemsize == block.nbytes
            and c_strides(key.shape) == key.strides
        ):
            return [tensor_of(block.view(dtype).reshape(key.shape))]
    return views_of(torch.from_numpy(block), places)


def views_of(block: torch.Tensor, places: Sequence[tuple[int, ViewKey]]) -> list[torch.Tensor]:
    """The view of each ``(offset, key)`` of ``places`` on ``block``'s storage, ``offset``
    bytes into ``block``; a ValueError where an offset is not a multiple of the view's
    element size."""
    # set_ onto the block's storage: every view shares that one storage (and its
    # allocation), as the saved views shared theirs before the offload.
    storage, base, device = block.untyped_storage(), block.storage_offset(), block.device
    views = []
    for offset, key in places:
        first = base + offset
        itemsize = key.itemsize
        if first % itemsize:
            raise ValueError(
                f"a {key.dtype} view cannot start at byte {first} of a restored span "
                f"(not a multiple of its {itemsize}-byte elements)"
            )
        view = torch.empty(0, dtype=dtype_named(key.dtype), device=device)
        views.append(view.set_(storage, first // itemsize, key.shape, key.strides))
    return views
