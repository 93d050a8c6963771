"""Torch tensors as host arrays and back, without copies where torch allows.

- A CPU tensor's ``numpy()`` is a view of its memory (any strides) and ``from_numpy``
  shares memory the other way: the CPU copy engine serves CPU tensors.
- numpy has no bfloat16, and neither call takes one: a bfloat16 tensor's host array is
  the tensor viewed as ``int16`` (the same 2-byte elements, any strides), then as
  ``ml_dtypes``' bfloat16 (``ppswap.core.dtypes``), and back the same way; no copy either
  way. Without ``ml_dtypes`` a bfloat16 tensor is refused naming the package.
- A dtype numpy lacks (the float8 ones) is refused naming the dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from ppswap.backends.cpu_engine import contiguous_strides
from ppswap.backends.types import HostArray
from ppswap.core.dtypes import BFLOAT16, BFLOAT16_MISSING, is_bfloat16

__all__ = ["c_strides", "dtype_named", "numpy_dtype_of", "numpy_of", "tensor_of", "upload"]

_DTYPES_NAMED: dict[str, torch.dtype] = {}
"""A dtype's name (``str(dtype)``) -> the dtype: ``dtype_named``'s cache."""


@functools.lru_cache(maxsize=64)
def numpy_dtype_of(dtype: torch.dtype) -> np.dtype[Any] | None:
    """The host array dtype of ``dtype`` (bfloat16: ``ml_dtypes``'; None where numpy
    has none), found once per dtype."""
    if dtype is torch.bfloat16:
        return BFLOAT16
    try:
        found: np.dtype[Any] = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # dtypes numpy lacks (the float8 ones, ...)
        return None
    return found


@functools.lru_cache(maxsize=1024)
def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``contiguous_strides(shape)``, made once per shape."""
    return contiguous_strides(shape)


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype ``str(dtype)`` names (``"torch.float32"``)."""
    dtype = _DTYPES_NAMED.get(name)
    if dtype is None:
        dtype = getattr(torch, name.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name!r} names no torch dtype")
        _DTYPES_NAMED[name] = dtype
    return dtype


def numpy_of(tensor: torch.Tensor, *, detach: bool = False) -> HostArray:
    """A CPU tensor's numpy view (bfloat16: through ``int16``, module docstring); a
    TypeError naming the dtype where numpy has none. ``detach``: of a tensor that may
    require grad (``numpy(force=True)``: one call instead of ``detach()`` and ``numpy()``;
    a view, for a CPU tensor that is not a lazily conjugated or negated view)."""
    if tensor.dtype is torch.bfloat16:
        if BFLOAT16 is None:
            raise TypeError(
                f"a torch.bfloat16 tensor cannot be read as a numpy array: {BFLOAT16_MISSING}"
            )
        bits: HostArray = tensor.view(torch.int16).numpy(force=detach)
        return bits.view(BFLOAT16)
    try:
        array: HostArray = tensor.numpy(force=detach)
    except TypeError as exc:
        raise TypeError(
            f"a {tensor.dtype} tensor of shape {tuple(tensor.shape)} cannot be read as a "
            "numpy array (numpy has no such dtype): the torch backend moves micro-batches, "
            "losses, P2P messages between processes and swapped CPU activations through "
            "numpy arrays, so it runs float32, float16, bfloat16 and float64 models, not "
            f"{tensor.dtype} ones"
        ) from exc
    return array


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without the host waiting for the device: staged in
    page-locked memory and copied with ``non_blocking=True`` on the current stream (a
    pageable copy would make the host wait for the stream to drain first). The caching
    host allocator keeps the staging buffer until the copy is done."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def tensor_of(array: HostArray) -> torch.Tensor:
    """The tensor sharing ``array``'s memory (a numpy bfloat16 array, ``ml_dtypes``' or
    MindSpore's: a ``torch.bfloat16`` one, through ``int16``)."""
    if is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
