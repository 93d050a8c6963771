"""The torch backend's saved-tensor hooks: the swap layer's pack and unpack with torch's
own in-place check, and how to tell them from other hooks.

With saved-tensor hooks installed torch no longer checks a saved tensor's version at
unpack ("one of the variables needed for gradient computation has been modified by an
inplace operation"), and every pipeline forward runs under the swap layer's hooks.
:class:`CheckedHooks` makes that check itself: pack records the tensor's version and a
weak reference to it; when unpack hands back that same tensor (it stayed on device) and
its version moved, :class:`SavedTensorModifiedError` is raised instead of a backward on
modified values. A tensor the swap layer restored from its host copy holds the values
the forward saved (checked before the copy and before the device tensor was dropped): a
later write to the original cannot reach it, as with ``torch.autograd.graph.save_on_cpu``.

Only the innermost hooks apply. ``top_saved_tensors_hooks`` (torch's private
``_top_saved_tensors_default_hooks``; None where torch lacks it) names them, and hooks
that are :class:`CheckedHooks` methods are ppswap's.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from ppswap.backends.types import PackHook, UnpackHook

__all__ = ["CheckedHooks", "SavedTensorModifiedError", "top_saved_tensors_hooks"]


class SavedTensorModifiedError(RuntimeError):
    """A tensor saved for backward was modified in place before the backward read it
    (what torch itself refuses when no saved-tensor hooks are installed)."""


class Saved:
    """What the graph keeps for one saved tensor: the swap layer's packed value, the
    tensor's version when it was saved, and how to recognise the tensor when unpack
    returns it: ``origin`` is a weak reference to it (a weak one, so a swapped tensor is
    still freed), or None where the packed value is the tensor itself (the graph holds
    it anyway). ``version`` is None for a tensor type without weak references: not
    checked."""

    __slots__ = ("origin", "packed", "version")

    def __init__(
        self, packed: Any, origin: weakref.ref[torch.Tensor] | None, version: int | None
    ) -> None:
        self.packed = packed
        self.origin = origin
        self.version = version


class CheckedHooks:
    """The swap layer's ``pack`` / ``unpack`` with torch's saved-tensor version check
    (module docstring); hooks that are this class's methods are ppswap's own
    (:meth:`TorchBackend.foreign_saved_tensors_hooks`)."""

    __slots__ = ("_pack", "_unpack")

    def __init__(self, pack: PackHook, unpack: UnpackHook) -> None:
        self._pack, self._unpack = pack, unpack

    def pack(self, tensor: torch.Tensor) -> Saved:
        version: int | None = tensor._version
        packed = self._pack(tensor)
        if packed is tensor:
            return Saved(packed, None, version)
        try:
            origin: weakref.ref[torch.Tensor] | None = weakref.ref(tensor)
        except TypeError:  # a tensor type without weak references: not checked
            origin, version = None, None
        return Saved(packed, origin, version)

    def unpack(self, saved: Saved) -> torch.Tensor:
        packed = saved.packed
        tensor: torch.Tensor = self._unpack(packed)
        version = saved.version
        if version is None or int(tensor._version) == version:
            return tensor
        origin = saved.origin
        if tensor is (packed if origin is None else origin()):
            tag = getattr(packed, "tag", None)
            named = f" {tag!r}" if isinstance(tag, str) else ""
            raise SavedTensorModifiedError(
                f"a tensor saved for backward{named} (shape {tuple(tensor.shape)}, "
                f"{tensor.dtype}) was modified in place after its forward saved it (version "
                f"{version} -> {int(tensor._version)}): its backward would read the "
                "modified values (torch refuses this too: 'one of the variables needed for "
                "gradient computation has been modified by an inplace operation'); modify a "
                ".clone() instead, or use the out-of-place operation"
            )
        return tensor


# torch 2.11-2.14: the innermost saved-tensor hooks active now, or None (no public API)
top_saved_tensors_hooks: Callable[[bool], tuple[Any, Any] | None] | None = getattr(
    torch._C._autograd, "_top_saved_tensors_default_hooks", None
)
