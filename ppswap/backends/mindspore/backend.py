"""The MindSpore (PyNative) backend: ``mindspore.nn.Cell`` stages on MindSpore tensors.

Facts this relies on (measured on mindspore 2.10, CPU):

- Inside a saved-tensor pack hook, parameters and inputs arrive as *new* Tensor objects
  sharing storage with the originals (``t is x`` and ``isinstance(t, Parameter)`` are
  both False): identity is by storage (``untyped_storage().data_ptr()``).
- ``asnumpy()`` of a contiguous CPU tensor is a view of its memory (it keeps the device
  address alive); ``Tensor.from_numpy`` shares memory the other way. ``asnumpy()`` costs
  20-40 us a call (numpy parses the buffer format it exports, in Python), so the swap
  layer's copy sources are numpy views made from the storage's address
  (``untyped_storage().data_ptr()``, the host address on CPU) instead: a few us.
- View ops (``transpose``, ``unbind``, slicing, ``reshape``) return views sharing their
  input's storage, but every tensor autograd saves arrives contiguous, at offset 0, in a
  storage of its own (views are copied first): two saved tensors never share a storage,
  so each storage span the swap layer moves is one saved tensor. ``asnumpy()`` of a
  strided tensor is a copy, and ``Tensor.from_numpy`` of a strided array copies too.
- ``_version`` is never bumped (not by ``add_``, ``mul_``, ``__setitem__`` or numpy writes
  through ``asnumpy()`` views): :meth:`MindSporeBackend.version_of` returns None and the
  swap layer checks content digests instead.
- Asynchronous dispatch (the default) runs every op through a pipeline of worker threads
  (``frontend_queue``, ``bprop_queue``, ``backend_queue``, the actor and kernel threads)
  whose hand-offs busy-wait: ``AsyncRQueue::Wait`` is a bare spin loop. With fewer cores
  than spinning threads every hand-off waits for the OS to preempt a spinner: a plain
  forward/backward loop of the demo's stage took 260-300 ms per iteration here (4 million
  involuntary context switches in 20 iterations) against 22 ms with synchronous dispatch.
  On CPU there is no device to overlap with, so :meth:`MindSporeBackend.run_scope` turns
  synchronous dispatch on for the run and restores the previous setting after it. The
  worker threads' spin behaviour is fixed when MindSpore first launches a kernel
  asynchronously: a process that ran asynchronous kernels before its first run keeps the
  slow hand-offs (measured: 130-300 ms per iteration even with synchronous dispatch on).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn
from mindspore import context as ms_context
from mindspore._c_expression import ms_ctx_param
from mindspore.common import dtype as mstype

from ppswap.backends.autograd import Autograd
from ppswap.backends.base import (
    CopyEngine,
    DeviceMemory,
    ForwardScope,
    RngStream,
    StorageRef,
    ViewKey,
)
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.backends.mindspore import recompute
from ppswap.backends.mindspore.autograd import MindSporeAutograd
from ppswap.backends.types import HostArray, Module, PackHook, UnpackHook
from ppswap.scheduler.config import SavedUntil

__all__ = ["MindSporeBackend", "SwapWrapperCell"]


def _numpy_dtypes() -> dict[str, np.dtype[Any]]:
    """``str(dtype)`` (``"Float32"``) -> numpy dtype, for every MindSpore dtype numpy can
    hold. Built once: the public ``dtype_to_nptype`` logs a deprecation warning on every
    call (mindspore 2.7+), which cost a write to stderr per restored tensor."""
    convert = getattr(mstype, "_dtype_to_nptype", None) or mstype.dtype_to_nptype
    table = {}
    for dtype in mstype.all_types:
        try:
            table[str(dtype)] = np.dtype(convert(dtype))
        except (KeyError, TypeError):  # int4, float8 kinds: no numpy dtype
            continue
    return table


_NUMPY_DTYPES = _numpy_dtypes()
_VIEW_DTYPES: dict[Any, tuple[str, int]] = {}
"""MindSpore dtype -> (its name, its itemsize): what a ViewKey records."""


def _numpy_dtype_named(name: str) -> np.dtype[Any]:
    """The numpy dtype of the MindSpore dtype ``str(dtype)`` names (``"Float32"``)."""
    dtype = _NUMPY_DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"{name!r} names no MindSpore dtype that numpy can hold")
    return dtype


class _HostBytes:
    """``nbytes`` bytes of a CPU tensor's memory at ``address``, as numpy reads them
    (``np.asarray`` of it is a ``uint8`` view); it holds the tensor, and the array holds
    it, so the memory outlives every array made from it."""

    __slots__ = ("__array_interface__", "tensor")

    def __init__(self, tensor: Tensor, address: int, nbytes: int) -> None:
        self.tensor = tensor
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


class SwapWrapperCell(nn.Cell):  # type: ignore[misc]
    """``swap_wrapper(cell)``: a cell whose forward runs the wrapped cell's through
    ``run`` (the swap layer's capture). Its parameters are the wrapped cell's, in the same
    order; their *names* gain the ``module.`` path segment, as with any wrapper cell."""

    def __init__(self, module: nn.Cell, run: Callable[[Callable[[], Any]], Any]) -> None:
        super().__init__(auto_prefix=False)
        self.module = module
        self.swap_run = run

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        return self.swap_run(lambda: self.module(*args, **kwargs))


class RecomputeWrapperCell(nn.Cell):  # type: ignore[misc]
    """``recompute_wrapper(cell)``: a cell whose forward hands the wrapped cell and its
    arguments to ``region`` (``ppswap.swap.recompute``). Its parameters are the wrapped
    cell's, in the same order; their *names* gain the ``module.`` path segment."""

    def __init__(
        self, module: nn.Cell, region: Callable[[nn.Cell, tuple[Any, ...], dict[str, Any]], Any]
    ) -> None:
        super().__init__(auto_prefix=False)
        self.module = module
        self.recompute_region = region

    def construct(self, *args: Any, **kwargs: Any) -> Any:
        return self.recompute_region(self.module, args, kwargs)


def _refuse_unreplayable_dropout(module: nn.Cell) -> None:
    """``nn.Dropout`` draws its masks from per-operator states that no generator state
    restores, so a recomputed block would train on other masks than its forward's: refused
    (``mint.nn.Dropout`` draws from the default generator, which the re-run restores)."""
    for name, cell in module.cells_and_names():
        if type(cell) is nn.Dropout and float(cell.p) > 0.0:
            raise ValueError(
                f"recompute_wrapper: {type(module).__name__} holds nn.Dropout "
                f"{name or '(the block)'!r} with p={float(cell.p):g}, whose masks a re-run "
                "cannot replay on MindSpore; use mindspore.mint.nn.Dropout, or leave the "
                "block out of recompute_wrapper"
            )


def _set_synchronous(enabled: bool) -> None:
    # ms.set_context(pynative_synchronize=...) logs a deprecation warning on every call;
    # ms.runtime.launch_blocking() cannot be turned off again. This is the setting both
    # of them change.
    ms_context._context().set_param(ms_ctx_param.pynative_synchronize, enabled)


class MindSporeBackend:
    """:class:`~ppswap.backends.base.Backend` for MindSpore PyNative."""

    name = "mindspore"
    tensor_name = "mindspore.Tensor"
    module_name = "mindspore.nn.Cell"
    saved_until: SavedUntil = "input"  # mindspore.vjp computes dx and dw at BWD_INPUT

    def __init__(self) -> None:
        self.autograd: Autograd = MindSporeAutograd()

    def __repr__(self) -> str:
        return "MindSporeBackend()"

    # -- modules and parameters -------------------------------------------------------
    def is_module(self, obj: object) -> bool:
        return isinstance(obj, nn.Cell)

    def trainable_parameters(self, module: Module) -> tuple[Tensor, ...]:
        return tuple(module.trainable_params())

    def all_parameters(self, module: Module) -> list[Tensor]:
        return list(module.get_parameters())

    def submodules(self, module: Module) -> Iterator[tuple[str, Module]]:
        yield from module.cells_and_names()

    def module_state(self, module: Module) -> list[Tensor]:
        found: list[Tensor] = list(module.get_parameters())
        for _, sub in module.cells_and_names():
            buffers = getattr(sub, "_buffers", None)
            if isinstance(buffers, dict):
                found.extend(v for v in buffers.values() if isinstance(v, Tensor))
            found.extend(
                v
                for v in vars(sub).values()
                if isinstance(v, Tensor) and not isinstance(v, Parameter)
            )
        return found

    def wrap_for_swap(self, module: Module, run: Callable[[Callable[[], Any]], Any]) -> Module:
        return SwapWrapperCell(module, run)

    def wrap_for_recompute(
        self, module: Module, region: Callable[[Module, tuple[Any, ...], dict[str, Any]], Any]
    ) -> Module:
        _refuse_unreplayable_dropout(module)
        return RecomputeWrapperCell(module, region)

    def parameter_name(self, param: Tensor) -> str:
        return str(param.name)

    def set_parameter_data(self, param: Tensor, data: HostArray) -> None:
        param.set_data(Tensor(np.array(data, copy=True)))

    # -- tensors ----------------------------------------------------------------------
    def is_tensor(self, obj: object) -> bool:
        return isinstance(obj, Tensor)

    def is_parameter(self, obj: object) -> bool:
        return isinstance(obj, Parameter)

    def storage_of(self, tensor: Tensor) -> StorageRef:
        storage = tensor.untyped_storage()
        return StorageRef(int(storage.data_ptr()), int(storage.nbytes()))

    def is_lazy_view(self, tensor: Tensor) -> bool:
        return False  # MindSpore 2.10 has no lazily conjugated or negated views

    def view_key(self, tensor: Tensor, storage: StorageRef) -> ViewKey:
        dtype = tensor.dtype
        named = _VIEW_DTYPES.get(dtype)
        if named is None:  # str(dtype) costs microseconds: once per dtype
            named = _VIEW_DTYPES[dtype] = (str(dtype), int(tensor.itemsize))
        return ViewKey(
            storage.ptr,
            int(tensor.storage_offset()),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            *named,
        )

    def storage_bytes(self, tensor: Tensor, start: int, nbytes: int) -> Tensor | None:
        data = self.host_bytes(tensor, start, nbytes)
        return None if data is None else Tensor.from_numpy(data)

    def host_bytes(self, tensor: Tensor, start: int, nbytes: int) -> HostArray | None:
        # Only through a contiguous CPU tensor covering those bytes (host_views could not
        # rebuild a strided view: from_numpy copies). Enough here: the saved tensors arrive
        # contiguous, each in a storage of its own (module docstring), so a span is one
        # tensor's bytes. Read through the storage's address: asnumpy() costs 20-40 us a
        # call (numpy parses its buffer format in Python), this a few.
        first = int(tensor.storage_offset()) * int(tensor.itemsize)
        if (
            tensor.device != "CPU"
            or not tensor.is_contiguous()
            or start < first
            or start + nbytes > first + tensor.nbytes
        ):
            return None
        address = int(tensor.untyped_storage().data_ptr()) + start
        return np.asarray(_HostBytes(tensor, address, nbytes))

    def views_of(self, block: Tensor, places: Sequence[tuple[int, ViewKey]]) -> list[Tensor]:
        return self.host_views(block.asnumpy(), places)

    def host_views(self, block: HostArray, places: Sequence[tuple[int, ViewKey]]) -> list[Tensor]:
        # Tensors from numpy views of the block's memory (from_numpy shares it; a strided
        # view would come back as a contiguous copy, but saved tensors are contiguous).
        views = []
        for offset, key in places:
            array: HostArray = np.ndarray(
                key.shape,
                dtype=_numpy_dtype_named(key.dtype),
                buffer=block,
                offset=offset,
                strides=tuple(s * key.itemsize for s in key.strides),
            )
            views.append(Tensor.from_numpy(array))
        return views

    def data_nbytes(self, tensor: Tensor) -> int:
        return int(tensor.nbytes)

    def shape_of(self, tensor: Tensor) -> tuple[int, ...]:
        return tuple(tensor.shape)

    def version_of(self, tensor: Tensor) -> int | None:
        return None

    def to_host(self, tensor: Tensor, *, copy: bool) -> HostArray:
        array: HostArray = tensor.asnumpy()
        return array.copy() if copy else array

    def from_host(self, array: HostArray, like: Tensor | None = None) -> Tensor:
        return Tensor.from_numpy(array)

    def to_payload(self, tensor: Tensor, *, copy: bool, host: bool) -> Any:
        # MindSpore tensors here live in host memory: a payload is always a numpy array
        # (a view of the tensor without ``copy``; the tensor must then outlive it).
        return self.to_host(tensor, copy=copy)

    def from_payload(self, payload: Any, like: Tensor | None) -> Tensor:
        return Tensor.from_numpy(payload)

    def device_of(self, module: Module) -> str:
        return str(ms.get_context("device_target")).lower()

    def keep_scalar(self, value: Tensor) -> float:
        return float(value)  # host memory (MindSpore runs on CPU here): nothing to wait for

    def host_floats(self, values: Sequence[Any]) -> list[float]:
        return [float(value) for value in values]

    def scalar_like(self, value: float, like: Tensor) -> Tensor:
        return Tensor(np.array(value, dtype=self.numpy_dtype(like) or np.float32))

    def zeros_like(self, tensor: Tensor) -> Tensor:
        return ms.ops.zeros_like(tensor)

    def give_grads(self, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
        # MindSpore's optimizers take the gradients as their argument (stage.grads), and
        # a Parameter has no gradient attribute to fill.
        return None

    def add_into(self, total: Tensor, addend: Tensor) -> Tensor:
        # Not Tensor.add_: on mindspore 2.10 CPU it is ten times slower than ``+`` and not
        # bit-identical to it (measured).
        return total + addend

    def numpy_dtype(self, obj: object) -> np.dtype[Any] | None:
        if isinstance(obj, np.ndarray):
            array_dtype: np.dtype[Any] = obj.dtype
            return array_dtype
        try:
            # MindSpore names its dtypes like numpy's, capitalised (Float32, Int64, Bool).
            dtype: np.dtype[Any] = np.dtype(str(getattr(obj, "dtype", "")).lower())
        except (TypeError, ValueError):
            return None
        # Extension dtypes (bfloat16) are void-like to numpy.
        return None if dtype.kind == "V" else dtype

    # -- capture ------------------------------------------------------------------------
    def saved_tensors_hooks(
        self, pack: PackHook, unpack: UnpackHook
    ) -> AbstractContextManager[None]:
        hooks: AbstractContextManager[None] = ms.saved_tensors_hooks(pack, unpack)
        return hooks

    def forward_context(self) -> object:
        """The default generator's state (``mindspore/recompute.py``)."""
        return recompute.forward_context()

    def rerun_forward(
        self, call: Callable[[], Any], context: object, pack: Callable[[Tensor], None]
    ) -> None:
        recompute.rerun_forward(call, context, pack)

    def foreign_saved_tensors_hooks(self) -> bool:
        return False  # MindSpore 2.10 shows no active hooks to Python

    def run_seed(self) -> int:
        return 0

    def rng_scope(self, stream: RngStream, device: str) -> AbstractContextManager[None]:
        # MindSpore's dropout ops draw from states of their own (measured: in one process,
        # pp4 with dropout, the same losses in every run and schedule, swap on and off).
        return nullcontext()

    # -- the run ------------------------------------------------------------------------
    def check_runnable(self) -> None:
        if ms.get_context("mode") != ms.PYNATIVE_MODE:
            raise ValueError(
                "the MindSpore execution mode must be PYNATIVE_MODE for pipeline runs (a "
                "forward and its backward are separate steps), got GRAPH_MODE: call "
                "mindspore.set_context(mode=mindspore.PYNATIVE_MODE)"
            )

    @contextmanager
    def run_scope(self) -> Iterator[None]:
        """Synchronous dispatch on CPU for the run (module docstring), then restored."""
        if ms.get_context("device_target") != "CPU":
            yield
            return
        previous = bool(ms.get_context("pynative_synchronize"))
        _set_synchronous(True)
        try:
            yield
        finally:
            _set_synchronous(previous)

    def caller_forward_scope(self, devices: Sequence[str]) -> ForwardScope:
        # MindSpore's mixed precision (``amp``) casts the network itself: no per-thread state
        return nullcontext

    def memory(self) -> DeviceMemory:
        return DeviceMemory(str(ms.get_context("device_target")), None, None)

    def reset_peak_memory(self) -> None:
        return None

    def copy_engine(self, device: str = "cpu") -> CopyEngine:
        if device != "cpu":
            raise ValueError(
                f"the MindSpore backend copies host memory only (device 'cpu'), got {device!r}"
            )
        return EmulatedDevice().for_backend(self)
