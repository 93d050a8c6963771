"""The opaque types of the backend seam: what the runtime holds without looking inside.

Tensors, modules and parameters belong to a tensor framework; the runtime passes them on
to a :class:`~ppswap.backends.base.Backend` (which reads them) and never inspects them
itself, so here they are ``Any``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy.typing as npt

__all__ = ["HostArray", "Module", "PackHook", "Tensor", "UnpackHook"]

Tensor = Any
"""A framework tensor (``mindspore.Tensor``, ``torch.Tensor``): opaque to the runtime."""

Module = Any
"""A framework module (``mindspore.nn.Cell``, ``torch.nn.Module``)."""

HostArray = npt.NDArray[Any]
"""A numpy array in host memory."""

PackHook = Callable[[Tensor], Any]
UnpackHook = Callable[[Any], Tensor]
