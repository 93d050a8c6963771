"""The torch backend: ``torch.nn.Module`` stages on torch tensors (CPU or CUDA).

Facts this relies on (torch 2.11-2.14):

- ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor the graph saves;
  parameters arrive as plain tensors sharing the parameter's storage (``t is w`` is
  False): identity is by storage (``untyped_storage().data_ptr()``), as on MindSpore.
- Saved tensors can be views sharing one storage (q, k and v of an ``unbind``, ``k``
  transposed, a 4-D ``matmul``'s operand as it is and reshaped), at offsets and with any
  strides. The swap layer moves a storage's used bytes once
  (:meth:`TorchBackend.storage_bytes`) and rebuilds every view on the restored span with
  ``set_`` (:meth:`TorchBackend.views_of`): the views share one storage again.
- ``_version`` counts in-place modifications of a tensor and every view of its storage:
  the swap layer compares it before the copy and before the device tensor is dropped, so
  no content digest is needed.
- With saved-tensor hooks installed torch no longer checks a saved tensor's version at
  unpack, and every pipeline forward runs under the swap layer's hooks: so
  :meth:`TorchBackend.saved_tensors_hooks` makes that check itself
  (``ppswap.backends.torch.hooks``).
- A CPU tensor's ``numpy()`` is a view of its memory (any strides) and ``from_numpy``
  shares memory the other way: the CPU copy engine serves CPU tensors. CUDA tensors go
  through the CUDA engine (``ppswap.backends.torch.cuda_engine``). numpy has no
  bfloat16, and neither call takes one: a bfloat16 tensor's host array is the tensor
  viewed as ``int16`` (the same 2-byte elements, any strides), then as ``ml_dtypes``'
  bfloat16 (``ppswap.core.dtypes``), and back the same way; no copy either way.
- A graph keeps views of the tensors it saved, parameters' included, whatever later
  becomes of ``param.data``: :meth:`TorchBackend.set_parameter_data` (FSDP's unshard /
  reshard) therefore refills one kept storage per unsharded shape and frees it by
  resizing it to 0 bytes, so resharding really frees the full parameters.
- Autograd is thread-safe, but the runtime still runs every stage on its one compute
  thread (one order of work per process, as on MindSpore). Autocast and the current
  CUDA device are per thread: the caller's are carried to the forwards there
  (``ppswap.backends.torch.caller``).
- Only the innermost saved-tensor hooks apply; torch names them only through a private
  function (``hooks.top_saved_tensors_hooks``; absent: every region installs its own),
  which :meth:`TorchBackend.foreign_saved_tensors_hooks` reads.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from ppswap.backends.autograd import Autograd
from ppswap.backends.base import (
    NO_STORAGE,
    CopyEngine,
    DeviceMemory,
    ForwardScope,
    RngStream,
    StorageRef,
    ViewKey,
)
from ppswap.backends.cpu_engine import EmulatedDevice, contiguous_strides
from ppswap.backends.torch import recompute
from ppswap.backends.torch.autograd import TorchAutograd
from ppswap.backends.torch.caller import forward_scope
from ppswap.backends.torch.cuda_engine import CudaCopyEngine
from ppswap.backends.torch.hooks import CheckedHooks, top_saved_tensors_hooks
from ppswap.backends.torch.rng import rng_scope, run_seed
from ppswap.backends.types import HostArray, Module, PackHook, UnpackHook
from ppswap.core.dtypes import BFLOAT16, BFLOAT16_MISSING, is_bfloat16
from ppswap.scheduler.config import SavedUntil

__all__ = ["SwapWrapperModule", "TorchBackend"]

_SLOTS_ATTR = "_ppswap_data_slots"
_VIEW_DTYPES: dict[torch.dtype, tuple[str, int]] = {}
"""dtype -> (its name, its element size): what a ViewKey records."""


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


@functools.lru_cache(maxsize=64)
def _numpy_dtype_of(dtype: torch.dtype) -> np.dtype[Any] | None:
    """The host array dtype of ``dtype`` (bfloat16: ``ml_dtypes``'; None where numpy
    has none), found once per dtype."""
    if dtype is torch.bfloat16:
        return BFLOAT16
    try:
        found: np.dtype[Any] = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # dtypes numpy lacks (the float8 ones, ...)
        return None
    return found


_DTYPES_NAMED: dict[str, torch.dtype] = {}


@functools.lru_cache(maxsize=1024)
def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """``contiguous_strides(shape)``, made once per shape."""
    return contiguous_strides(shape)


def _dtype_named(name: str) -> torch.dtype:
    """The torch dtype ``str(dtype)`` names (``"torch.float32"``)."""
    dtype = _DTYPES_NAMED.get(name)
    if dtype is None:
        dtype = getattr(torch, name.removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{name!r} names no torch dtype")
        _DTYPES_NAMED[name] = dtype
    return dtype


def _numpy_of(tensor: torch.Tensor, *, detach: bool = False) -> HostArray:
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


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without the host waiting for the device: staged in
    page-locked memory and copied with ``non_blocking=True`` on the current stream (a
    pageable copy would make the host wait for the stream to drain first). The caching
    host allocator keeps the staging buffer until the copy is done."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def _tensor_of(array: HostArray) -> torch.Tensor:
    """The tensor sharing ``array``'s memory (a numpy bfloat16 array, ``ml_dtypes``' or
    MindSpore's: a ``torch.bfloat16`` one, through ``int16``)."""
    if is_bfloat16(array.dtype):
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)


class TorchBackend:
    """:class:`~ppswap.backends.base.Backend` for torch."""

    name = "torch"
    tensor_name = "torch.Tensor"
    module_name = "torch.nn.Module"
    saved_until: SavedUntil = "weight"  # the dw pass reads the graph's saved tensors

    def __init__(self) -> None:
        self.autograd: Autograd = TorchAutograd()

    def __repr__(self) -> str:
        return "TorchBackend()"

    # -- modules and parameters -------------------------------------------------------
    def is_module(self, obj: object) -> bool:
        return isinstance(obj, nn.Module)

    def trainable_parameters(self, module: Module) -> tuple[torch.Tensor, ...]:
        return tuple(p for p in module.parameters() if p.requires_grad)

    def all_parameters(self, module: Module) -> list[torch.Tensor]:
        return list(module.parameters())

    def submodules(self, module: Module) -> Iterator[tuple[str, Module]]:
        yield from module.named_modules()

    def module_state(self, module: Module) -> list[torch.Tensor]:
        found: list[torch.Tensor] = list(module.parameters())
        found.extend(module.buffers())
        for sub in module.modules():
            found.extend(
                value
                for value in vars(sub).values()
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)
            )
        return found

    def wrap_for_swap(self, module: Module, run: Callable[[Callable[[], Any]], Any]) -> Module:
        return SwapWrapperModule(module, run)

    def wrap_for_recompute(
        self, module: Module, region: Callable[[Module, tuple[Any, ...], dict[str, Any]], Any]
    ) -> Module:
        return RecomputeWrapperModule(module, region)

    def parameter_name(self, param: torch.Tensor) -> str:
        return f"{type(param).__name__}{tuple(param.shape)}"

    def set_parameter_data(self, param: torch.Tensor, data: HostArray) -> None:
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
        source = _tensor_of(data if data.flags.writeable else data.copy())
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
    def is_tensor(self, obj: object) -> bool:
        return isinstance(obj, torch.Tensor)

    def is_parameter(self, obj: object) -> bool:
        return isinstance(obj, nn.Parameter)

    def storage_of(self, tensor: torch.Tensor) -> StorageRef:
        try:
            storage = tensor.untyped_storage()
        except RuntimeError:  # sparse and other non-strided layouts have no storage
            return NO_STORAGE
        return StorageRef(storage.data_ptr(), storage.nbytes())

    def view_key(self, tensor: torch.Tensor, storage: StorageRef) -> ViewKey:
        dtype = tensor.dtype
        named = _VIEW_DTYPES.get(dtype)
        if named is None:
            named = _VIEW_DTYPES[dtype] = (str(dtype), int(tensor.element_size()))
        return ViewKey(
            storage.ptr,
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            *named,
        )

    def is_lazy_view(self, tensor: torch.Tensor) -> bool:
        return tensor.is_conj() or tensor.is_neg()

    def storage_bytes(self, tensor: torch.Tensor, start: int, nbytes: int) -> torch.Tensor:
        span = torch.empty(0, dtype=torch.uint8, device=tensor.device)
        return span.set_(tensor.untyped_storage(), start, (nbytes,), (1,))

    def host_bytes(self, tensor: torch.Tensor, start: int, nbytes: int) -> HostArray | None:
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
            and _numpy_dtype_of(tensor.dtype) is not None
            and not self.is_lazy_view(tensor)
        ):
            elements = _numpy_of(tensor, detach=True)
            if elements.flags.c_contiguous:  # so reshape(-1) is a view, never a copy
                dense: HostArray = elements.reshape(-1).view(np.uint8)
                return dense
        return _numpy_of(self.storage_bytes(tensor, start, nbytes))

    def host_views(
        self, block: HostArray, places: Sequence[tuple[int, ViewKey]]
    ) -> list[torch.Tensor]:
        if len(places) == 1:
            # One C-contiguous view filling the block from its first byte (the common
            # case, and the span is then exactly its bytes): the block's memory as that
            # view, through numpy, without a torch op per view.
            ((offset, key),) = places
            dtype = _numpy_dtype_of(_dtype_named(key.dtype))
            if (
                offset == 0
                and dtype is not None
                and math.prod(key.shape) * key.itemsize == block.nbytes
                and _c_strides(key.shape) == key.strides
            ):
                return [_tensor_of(block.view(dtype).reshape(key.shape))]
        return self.views_of(torch.from_numpy(block), places)

    def views_of(
        self, block: torch.Tensor, places: Sequence[tuple[int, ViewKey]]
    ) -> list[torch.Tensor]:
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
            view = torch.empty(0, dtype=_dtype_named(key.dtype), device=device)
            views.append(view.set_(storage, first // itemsize, key.shape, key.strides))
        return views

    def data_nbytes(self, tensor: torch.Tensor) -> int:
        return int(tensor.numel() * tensor.element_size())

    def shape_of(self, tensor: torch.Tensor) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def version_of(self, tensor: torch.Tensor) -> int | None:
        version: int = tensor._version
        return version

    def to_host(self, tensor: torch.Tensor, *, copy: bool) -> HostArray:
        # A numpy view makes torch refuse to resize the tensor's storage from then on (it
        # would free memory under the view): a copy is taken from a clone, so reading a
        # parameter never pins its storage's size (set_parameter_data frees by resizing).
        data = tensor.detach()
        if data.device.type != "cpu":
            return _numpy_of(data.cpu())
        return _numpy_of(data.clone() if copy else data)

    def from_host(self, array: HostArray, like: torch.Tensor | None = None) -> torch.Tensor:
        tensor = _tensor_of(array)
        if like is not None and like.device.type != "cpu":
            return _upload(tensor, like.device)
        return tensor

    def to_payload(self, tensor: torch.Tensor, *, copy: bool, host: bool) -> Any:
        if host:
            return self.to_host(tensor, copy=copy)
        data = tensor.detach()
        return data.clone() if copy else data

    def from_payload(self, payload: Any, like: torch.Tensor | None) -> torch.Tensor:
        if isinstance(payload, torch.Tensor):
            if like is None or payload.device == like.device:
                return payload
            if payload.device.type == "cpu":
                return _upload(payload, like.device)
            return payload.to(like.device)
        return self.from_host(payload, like)

    def keep_scalar(self, value: Any) -> Any:
        # A tensor stays on its device (reading it now would wait for the device); a host
        # value (a numpy scalar) is kept as it is.
        return value.detach() if isinstance(value, torch.Tensor) else value

    def host_floats(self, values: Sequence[Any]) -> list[float]:
        # One transfer per (device, dtype): a stack of the values, copied to the host once
        # (float() of each CUDA value would wait for the device once per value).
        found: list[float | None] = [None] * len(values)
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for index, value in enumerate(values):
            if isinstance(value, torch.Tensor):
                groups.setdefault((value.device, value.dtype), []).append(index)
            else:
                found[index] = float(value)
        for indices in groups.values():
            stacked = torch.stack([values[i].reshape(()) for i in indices]).cpu()
            for index, number in zip(indices, stacked.tolist(), strict=True):
                found[index] = float(number)
        return [float(number) for number in found if number is not None]

    def scalar_like(self, value: float, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(value, dtype=like.dtype, device=like.device)

    def zeros_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(tensor)

    def give_grads(
        self, params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None]
    ) -> None:
        # As AccumulateGrad: the run's gradient becomes .grad where that is None (the same
        # tensor, no copy), else it is added into it in place; but a .grad that is a
        # stage's own gradient (set here, the parameter repeated: tied weights) is
        # replaced by the sum, so that stage's ``stage.grads`` stays its own.
        staged: set[int] = set()
        with torch.no_grad():
            for param, grad in zip(params, grads, strict=True):
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad
                    staged.add(id(param))
                elif id(param) in staged:
                    param.grad = param.grad + grad
                    staged.discard(id(param))
                else:
                    param.grad.add_(grad)

    def add_into(self, total: torch.Tensor, addend: torch.Tensor) -> torch.Tensor:
        return total.add_(addend)

    def numpy_dtype(self, obj: object) -> np.dtype[Any] | None:
        if isinstance(obj, np.ndarray):
            array_dtype: np.dtype[Any] = obj.dtype
            return array_dtype
        if isinstance(obj, torch.Tensor):
            return _numpy_dtype_of(obj.dtype)
        return None

    def device_of(self, module: Module) -> str:
        for param in module.parameters():
            return str(param.device)
        return "cpu"

    # -- capture ------------------------------------------------------------------------
    def saved_tensors_hooks(
        self, pack: PackHook, unpack: UnpackHook
    ) -> AbstractContextManager[None]:
        """Torch's saved-tensor hooks around ``pack`` / ``unpack``, with torch's own check
        that a saved tensor was not modified in place before its backward (module
        docstring)."""
        checked = CheckedHooks(pack, unpack)
        hooks: AbstractContextManager[None] = torch.autograd.graph.saved_tensors_hooks(
            checked.pack, checked.unpack
        )
        return hooks

    def run_seed(self) -> int:
        return run_seed()

    def rng_scope(self, stream: RngStream, device: str) -> AbstractContextManager[None]:
        """The stage's own generator states around its forward (``backends/torch/rng.py``)."""
        return rng_scope(stream, torch.device(device))

    def forward_context(self) -> object:
        """The generators and autocast settings of a forward (``torch/recompute.py``)."""
        return recompute.forward_context()

    def rerun_forward(
        self, call: Callable[[], Any], context: object, pack: Callable[[torch.Tensor], None]
    ) -> None:
        recompute.rerun_forward(call, context, pack)

    def foreign_saved_tensors_hooks(self) -> bool:
        """Whether the innermost saved-tensor hooks active now are not ppswap's: those of
        ``torch.utils.checkpoint`` (non-reentrant), ``save_on_cpu`` or the user's own."""
        if top_saved_tensors_hooks is None:
            return False
        top = top_saved_tensors_hooks(False)
        return top is not None and not isinstance(getattr(top[0], "__self__", None), CheckedHooks)

    # -- the run ------------------------------------------------------------------------
    def check_runnable(self) -> None:
        return None

    def run_scope(self) -> AbstractContextManager[None]:
        return nullcontext()

    def caller_forward_scope(self, devices: Sequence[str]) -> ForwardScope:
        return forward_scope(devices)  # autocast, CUDA device (backends/torch/caller.py)

    def memory(self) -> DeviceMemory:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return DeviceMemory(
                "cuda", torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()
            )
        return DeviceMemory("cpu", None, None)

    def reset_peak_memory(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()

    def copy_engine(self, device: str = "cpu") -> CopyEngine:
        if device.startswith("cuda"):
            return CudaCopyEngine(torch.device(device)).for_backend(self)
        return EmulatedDevice().for_backend(self)
