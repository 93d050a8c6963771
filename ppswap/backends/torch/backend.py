"""The torch backend: ``torch.nn.Module`` stages on torch tensors (CPU or CUDA).

Facts this relies on (torch 2.11-2.14):

- ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor the graph saves;
  parameters arrive as plain tensors sharing the parameter's storage (``t is w`` is
  False): identity is by storage (``untyped_storage().data_ptr()``), as on MindSpore.
- Saved tensors can be views sharing one storage, at offsets and with any strides: the
  swap layer moves a storage's used bytes once and rebuilds every view on the restored
  span with ``set_`` (``ppswap.backends.torch.storage_spans``).
- ``_version`` counts in-place modifications of a tensor and every view of its storage:
  the swap layer compares it before the copy and before the device tensor is dropped, so
  no content digest is needed.
- With saved-tensor hooks installed torch no longer checks a saved tensor's version at
  unpack, and every pipeline forward runs under the swap layer's hooks: so
  :meth:`TorchBackend.saved_tensors_hooks` makes that check itself
  (``ppswap.backends.torch.hooks``).
- A CPU tensor's ``numpy()`` is a view of its memory and ``from_numpy`` shares memory
  the other way (bfloat16 through ``int16``): the CPU copy engine serves CPU tensors
  (``ppswap.backends.torch.host_arrays``). CUDA tensors go through the CUDA engine
  (``ppswap.backends.torch.cuda_engine``).
- A graph keeps views of the tensors it saved, parameters' included, whatever later
  becomes of ``param.data``: :meth:`TorchBackend.set_parameter_data` (FSDP's unshard /
  reshard) therefore refills one kept storage per unsharded shape and frees it by
  resizing it to 0 bytes (``ppswap.backends.torch.modules``).
- Autograd is thread-safe, but the runtime still runs every stage on its one compute
  thread (one order of work per process, as on MindSpore). Autocast and the current
  CUDA device are per thread: the caller's are carried to the forwards there
  (``ppswap.backends.torch.caller``).
- Only the innermost saved-tensor hooks apply; torch names them only through a private
  function (``hooks.top_saved_tensors_hooks``; absent: every region installs its own),
  which :meth:`TorchBackend.foreign_saved_tensors_hooks` reads.
"""

from __future__ import annotations

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
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.backends.torch import recompute, storage_spans
from ppswap.backends.torch.autograd import TorchAutograd
from ppswap.backends.torch.caller import forward_scope
from ppswap.backends.torch.cuda_engine import CudaCopyEngine
from ppswap.backends.torch.hooks import CheckedHooks, top_saved_tensors_hooks
from ppswap.backends.torch.host_arrays import numpy_dtype_of, numpy_of, tensor_of, upload
from ppswap.backends.torch.modules import (
    RecomputeWrapperModule,
    SwapWrapperModule,
    install_parameter_data,
)
from ppswap.backends.torch.rng import rng_scope, run_seed
from ppswap.backends.types import HostArray, Module, PackHook, UnpackHook
from ppswap.scheduler.config import SavedUntil

__all__ = ["SwapWrapperModule", "TorchBackend"]

_VIEW_DTYPES: dict[torch.dtype, tuple[str, int]] = {}
"""dtype -> (its name, its element size): what a ViewKey records."""


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
        """Replace ``param``'s data with a copy of ``data``, in a storage ``param`` keeps
        per grown shape (``modules.install_parameter_data``)."""
        install_parameter_data(param, data)

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
        return storage_spans.storage_bytes(tensor, start, nbytes)

    def host_bytes(self, tensor: torch.Tensor, start: int, nbytes: int) -> HostArray | None:
        return storage_spans.host_bytes(tensor, start, nbytes)

    def host_views(
        self, block: HostArray, places: Sequence[tuple[int, ViewKey]]
    ) -> list[torch.Tensor]:
        return storage_spans.host_views(block, places)

    def views_of(
        self, block: torch.Tensor, places: Sequence[tuple[int, ViewKey]]
    ) -> list[torch.Tensor]:
        return storage_spans.views_of(block, places)

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
            return numpy_of(data.cpu())
        return numpy_of(data.clone() if copy else data)

    def from_host(self, array: HostArray, like: torch.Tensor | None = None) -> torch.Tensor:
        tensor = tensor_of(array)
        if like is not None and like.device.type != "cpu":
            return upload(tensor, like.device)
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
                return upload(payload, like.device)
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
            return numpy_dtype_of(obj.dtype)
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
