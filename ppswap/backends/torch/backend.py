"""The torch backend: ``torch.nn.Module`` stages on torch tensors (CPU or CUDA).

Facts this relies on (torch 2.11-2.14):

- ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor the graph saves;
  parameters arrive as plain tensors sharing the parameter's storage (``t is w`` is
  False): identity is by storage (``untyped_storage().data_ptr()``), as on MindSpore.
- ``_version`` counts in-place modifications of a tensor and every view of its storage:
  the swap layer compares it before the copy and before the device tensor is dropped, so
  no content digest is needed.
- A CPU tensor's ``numpy()`` is a view of its memory (any strides) and ``from_numpy``
  shares memory the other way: the CPU copy engine serves CPU tensors. CUDA tensors go
  through the CUDA engine (``ppswap.backends.torch.cuda_engine``).
- Autograd is thread-safe, but the runtime still runs every stage on its one compute
  thread (one order of work per process, as on MindSpore).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch
from torch import nn

from ppswap.backends.base import (
    Autograd,
    CopyEngine,
    DeviceMemory,
    HostArray,
    Module,
    PackHook,
    StorageRef,
    UnpackHook,
    ViewKey,
)
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.backends.torch.autograd import TorchAutograd
from ppswap.backends.torch.cuda_engine import CudaCopyEngine

__all__ = ["SwapWrapperModule", "TorchBackend"]


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


def _numpy_dtype_of(dtype: torch.dtype) -> np.dtype[Any] | None:
    try:
        found: np.dtype[Any] = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:  # bfloat16 and other dtypes numpy lacks
        return None
    return found


class TorchBackend:
    """:class:`~ppswap.backends.base.Backend` for torch."""

    name = "torch"
    tensor_name = "torch.Tensor"
    module_name = "torch.nn.Module"

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

    def parameter_name(self, param: torch.Tensor) -> str:
        return f"{type(param).__name__}{tuple(param.shape)}"

    def set_parameter_data(self, param: torch.Tensor, data: HostArray) -> None:
        param.data = torch.from_numpy(np.array(data, copy=True)).to(param.device)

    # -- tensors ----------------------------------------------------------------------
    def is_tensor(self, obj: object) -> bool:
        return isinstance(obj, torch.Tensor)

    def is_parameter(self, obj: object) -> bool:
        return isinstance(obj, nn.Parameter)

    def storage_of(self, tensor: torch.Tensor) -> StorageRef:
        storage = tensor.untyped_storage()
        return StorageRef(int(storage.data_ptr()), int(storage.nbytes()))

    def view_key(self, tensor: torch.Tensor, storage: StorageRef) -> ViewKey:
        return ViewKey(
            storage.ptr,
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            str(tensor.dtype),
        )

    def data_nbytes(self, tensor: torch.Tensor) -> int:
        return int(tensor.numel() * tensor.element_size())

    def shape_of(self, tensor: torch.Tensor) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def version_of(self, tensor: torch.Tensor) -> int | None:
        return int(tensor._version)

    def to_host(self, tensor: torch.Tensor, *, copy: bool) -> HostArray:
        data = tensor.detach()
        if data.device.type != "cpu":
            return data.cpu().numpy()
        array: HostArray = data.numpy()
        return array.copy() if copy else array

    def from_host(self, array: HostArray, like: torch.Tensor | None = None) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if like is not None and like.device.type != "cpu":
            return tensor.to(like.device)
        return tensor

    def to_payload(self, tensor: torch.Tensor, *, copy: bool, host: bool) -> Any:
        if host:
            return self.to_host(tensor, copy=copy)
        data = tensor.detach()
        return data.clone() if copy else data

    def from_payload(self, payload: Any, like: torch.Tensor | None) -> torch.Tensor:
        if isinstance(payload, torch.Tensor):
            return payload if like is None else payload.to(like.device)
        return self.from_host(payload, like)

    def scalar_like(self, value: float, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(value, dtype=like.dtype, device=like.device)

    def zeros_like(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(tensor)

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
        hooks: AbstractContextManager[None] = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        return hooks

    # -- the run ------------------------------------------------------------------------
    def check_runnable(self) -> None:
        return None

    def run_scope(self) -> AbstractContextManager[None]:
        return nullcontext()

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
