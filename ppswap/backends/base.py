"""The backend seam: everything the runtime needs from a tensor framework.

The runtime (scheduler, stage, swap, actors, fsdp) never imports a tensor framework; it
reaches one only through a :class:`Backend` (``ppswap.backends.mindspore``,
``ppswap.backends.torch``), chosen from the stages' modules by
:func:`ppswap.backends.backend_for`. Tensors, modules and parameters are opaque objects
to the runtime (``ppswap.backends.types``); only the backend looks inside them.

What a backend provides, grouped as the runtime uses it:

- modules and parameters: the trainable parameters (the order ``stage.grads`` follows),
  the module state swap must never move (parameters, buffers, plain tensor attributes),
  a swap-capturing wrapper around a module (``swap_wrapper``);
- tensors: storage identity and size (:class:`StorageRef`), exact view identity
  (:class:`ViewKey`), the in-place modification counter where the framework has one,
  host views and tensors made from host arrays (P2P payloads, restored activations), a
  byte range of a storage and views rebuilt into a restored one (how the views of one
  storage move together);
- capture: saved-tensor hooks around a forward;
- autograd: a stage's forward recorded now and its backward run later, in any order,
  with the dx/dw split (``Backend.autograd``, the protocol in ``ppswap.backends.autograd``);
- the run's scope on the compute thread (settings the framework needs while a run
  executes, restored after it), the caller's per-thread settings its forwards must run
  under (:data:`ForwardScope`), memory statistics, and the copy engine that moves saved
  activations between device and host (:class:`CopyEngine`).

Threading: every call that touches a framework tensor runs on the runtime's compute
thread, except the copy-engine primitives documented as copy-thread calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np

from ppswap.backends.autograd import Autograd
from ppswap.backends.types import HostArray, Module, PackHook, Tensor, UnpackHook
from ppswap.core.oneshot import OneShot
from ppswap.scheduler.config import SavedUntil

__all__ = [
    "NO_STORAGE",
    "Backend",
    "CopyEngine",
    "CopyEvent",
    "DeviceMemory",
    "ForwardScope",
    "RngStream",
    "StorageRef",
    "ViewKey",
]


class StorageRef(NamedTuple):
    """The storage a tensor lives in: base address and size in bytes (the whole storage,
    because that is what stays allocated while any view of it is alive). A named tuple:
    made and compared in C (the swap layer makes one per saved tensor and check)."""

    ptr: int
    nbytes: int


NO_STORAGE = StorageRef(0, 0)
"""What ``Backend.storage_of`` returns for a tensor without a storage of its own."""

ForwardScope = Callable[[], AbstractContextManager[None]]
"""Makes the context every forward of a run (with its loss) runs in on the compute thread:
the settings the thread that called ``run_schedule`` had when the run started
(``Backend.caller_forward_scope``)."""


class ViewKey(NamedTuple):
    """Exact identity of a view: same storage, offset, shape, strides and dtype (a named
    tuple: made and hashed in C, once per saved tensor).

    ``offset`` and ``strides`` count elements (as the frameworks report them), ``dtype`` is
    the framework's name of the element type and ``itemsize`` its size in bytes (implied
    by ``dtype``; it lets the framework-free swap layer place the view in its storage's
    bytes, :meth:`byte_range`).
    """

    storage_ptr: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str
    itemsize: int

    def byte_range(self) -> tuple[int, int]:
        """``(first, end)``: the bytes of its storage the view's elements occupy, counted
        from the storage's first byte (``first == end`` for a view without elements)."""
        low = high = self.offset
        for n, stride in zip(self.shape, self.strides, strict=True):
            if n == 0:
                return self.offset * self.itemsize, self.offset * self.itemsize
            if stride > 0:
                high += (n - 1) * stride
            else:
                low += (n - 1) * stride
        return low * self.itemsize, (high + 1) * self.itemsize


@dataclass(eq=False, slots=True)
class RngStream:
    """A stage's own random-number stream for one run (``Backend.rng_scope``): made from
    ``seed`` (the run's, ``Backend.run_seed``) and ``stage_index``; ``state`` holds the
    backend's generator state between the stage's forwards (None before the first)."""

    stage_index: int
    seed: int = 0
    state: Any = None


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """What the framework's allocator reports for the device the stages run on, in
    bytes; ``None`` where the device has no allocator statistics (MindSpore on CPU)."""

    device: str
    allocated: int | None
    peak_allocated: int | None


class CopyEvent(OneShot[None]):
    """Completion of one copy job, set once by the copy thread (a ``core.oneshot.OneShot``
    without a value).

    ``wait(timeout_s)`` blocks a thread; ``on_set(callback)`` runs ``callback`` once the
    event is set (at once if it already is, else on the thread that sets it), which is
    how the event loop learns of a completion without a thread waiting for it.
    """

    __slots__ = ()

    def set(self) -> None:
        self.set_value(None)


@runtime_checkable
class CopyEngine(Protocol):
    """How a saved tensor's bytes move between the device and host memory.

    The swap layer takes a chunk's copy sources on the compute thread when its forward
    ends (``span_sources``: O(1) per storage span, no copy) and runs each copy as one job
    on the rank's copy stream, where the engine's primitives move bytes (``d2h_many``
    for an offload's spans, into buffers of their own or slices of an ``acquire_host``
    bucket; ``h2d_block`` for a load's spans, ``h2d`` and ``member`` for a
    ``group_swap`` bucket's); after the job's completion event,
    ``restore_views`` (compute thread, O(1) per view) turns a loaded span back into the
    framework tensors of its views. Host buffers come from a pool that outlives runs
    (``release_host`` gives one back; thread-safe). ``host_view`` shows the bytes of a
    source or loaded span to the in-place checks where the host can read them;
    ``pinned`` says whether host buffers are page-locked (real DMA) or plain memory.

    An engine is made without knowing the framework (``EmulatedDevice(d2h_gbps=...)``);
    the runtime calls ``for_backend(backend)`` once per run and uses the engine it
    returns (the same pool, bound to that backend's tensors).
    """

    @property
    def pinned(self) -> bool: ...

    def for_backend(self, backend: Backend) -> CopyEngine:
        """This engine bound to ``backend``'s tensors (sharing the host pool)."""
        ...

    def can_move(self, tensor: Tensor) -> bool:
        """Compute thread, O(1): whether this engine can copy ``tensor`` (a CUDA engine
        moves the tensors of its own device only, not a CPU tensor a CUDA stage saved nor
        one on another GPU); a tensor it cannot stays put."""
        ...

    def check_devices(self, devices: Sequence[str]) -> None:
        """Before a run with swap: raise ValueError, in one line naming them, if this
        engine cannot serve stages on ``devices`` (``Backend.device_of``) together (a CUDA
        engine serves one device)."""
        ...

    def clear_pool(self) -> None:
        """Free every idle pooled host buffer (and cached device block, where the engine
        keeps them); those in use are unaffected."""
        ...

    def span_sources(self, spans: Sequence[tuple[Tensor, int, int]]) -> list[Any]:
        """Compute thread, when a chunk's forward ends: for each ``(tensor, start,
        nbytes)``, what the copy thread reads bytes ``[start, start + nbytes)`` of
        ``tensor``'s storage from (a storage span; it keeps the storage alive), or None
        where the framework cannot view those bytes through ``tensor``."""
        ...

    def d2h_many(
        self, sources: Sequence[Any], into: Sequence[HostArray | None] | None = None
    ) -> list[HostArray]:
        """Copy thread: every one of ``sources`` (an offload job's storage spans) to host,
        issued together and waited for once: each into its ``into`` entry (a slice of an
        acquired buffer, of its byte count) or, where that is None (or ``into`` is), into
        a pooled buffer of its own. Returns the host copies, complete; on a failure the
        buffers it took itself are given back."""
        ...

    def acquire_host(self, nbytes: int) -> HostArray:
        """A pooled ``uint8`` host buffer of exactly ``nbytes`` bytes."""
        ...

    def h2d(
        self, host: HostArray, strides: tuple[int, ...] | None = None, dtype: str | None = None
    ) -> Any:
        """Copy thread: fresh device memory holding ``host``'s data (a device handle),
        laid out with ``strides`` (in elements; None: C-contiguous) so a restored view
        computes exactly as the original did; ``dtype`` is the framework's name of the
        original dtype (``ViewKey.dtype``), for dtypes numpy has no type for."""
        ...

    def h2d_block(
        self, hosts: Sequence[HostArray], offsets: Sequence[int], nbytes: int
    ) -> list[Any]:
        """Copy thread: one fresh device block of ``nbytes`` bytes (a load job's storage
        spans), each of ``hosts`` (``uint8``) copied to its offset in it (64-byte aligned,
        within ``nbytes``), waited for once; each one's loaded span (a ``uint8`` device
        handle into the block, as ``restore_views`` takes). The block is freed when the last
        view restored into it is."""
        ...

    def member(
        self,
        block: Any,
        offset: int,
        host: HostArray,
        strides: tuple[int, ...] | None = None,
        dtype: str | None = None,
    ) -> Any:
        """Copy thread: the device handle of one member of a loaded bucket ``block``
        (what ``h2d`` returned for the bucket's bytes), ``offset`` bytes in, laid out like
        the member's host view ``host`` (same shape, dtype and byte count), with
        ``strides`` (in elements; a strided member costs one more copy)."""
        ...

    def restore_views(self, loaded: Any, places: Sequence[tuple[int, ViewKey]]) -> list[Tensor]:
        """Compute thread, O(1) per view: a loaded span (a device handle ``h2d``,
        ``member`` or ``load_now`` returned, ``uint8``) as the framework tensors of its
        views: for each ``(offset, key)`` a tensor ``offset`` bytes into it with ``key``'s
        shape, strides and dtype, sharing its memory (``Backend.views_of``)."""
        ...

    def load_now(
        self, host: HostArray, strides: tuple[int, ...] | None = None, dtype: str | None = None
    ) -> Any:
        """Compute thread: a synchronous copy of ``host`` into fresh device memory, outside
        the copy stream (backward's safety net when a load was never launched)."""
        ...

    def host_view(self, loaded: Any) -> HostArray | None:
        """The host-visible bytes of a device handle (for checks), or None on a device
        the host cannot read."""
        ...

    def release_host(self, buf: HostArray) -> None: ...


class Backend(Protocol):
    """One tensor framework, as the runtime sees it (see the module docstring)."""

    name: str
    """The framework's package name: ``"mindspore"``, ``"torch"``."""
    tensor_name: str
    """Its tensor type, for messages: ``"mindspore.Tensor"``, ``"torch.Tensor"``."""
    module_name: str
    """Its module type, for messages: ``"mindspore.nn.Cell"``, ``"torch.nn.Module"``."""
    autograd: Autograd
    saved_until: SavedUntil
    """When a chunk whose backward is split frees its saved tensors: ``"input"`` at its
    BWD_INPUT, ``"weight"`` at its BWD_WEIGHT (``"weight"`` exactly where
    ``autograd.defers_weight_grads``). Run planning hands it to the scheduler's memory
    model (``ScheduleConfig.saved_until``)."""

    # -- modules and parameters -------------------------------------------------------
    def is_module(self, obj: object) -> bool: ...

    def trainable_parameters(self, module: Module) -> tuple[Tensor, ...]: ...

    def all_parameters(self, module: Module) -> list[Tensor]:
        """Every parameter, trainable or not (what FSDP shards)."""
        ...

    def submodules(self, module: Module) -> Iterator[tuple[str, Module]]:
        """``(name, submodule)`` for the module and every module below it."""
        ...

    def module_state(self, module: Module) -> list[Tensor]:
        """Parameters, buffers and plain tensor attributes: what swap never moves."""
        ...

    def wrap_for_swap(self, module: Module, run: Callable[[Callable[[], Any]], Any]) -> Module:
        """A module whose forward runs ``module``'s through ``run`` (which installs the
        swap capture hooks); it exposes the same parameters in the same order."""
        ...

    def wrap_for_recompute(
        self, module: Module, region: Callable[[Module, tuple[Any, ...], dict[str, Any]], Any]
    ) -> Module:
        """A module (with attribute ``recompute_region``) whose forward returns
        ``region(module, args, kwargs)``; it exposes the same parameters in the same
        order (``ppswap.swap.recompute``)."""
        ...

    def parameter_name(self, param: Tensor) -> str: ...

    def set_parameter_data(self, param: Tensor, data: HostArray) -> None:
        """Replace ``param``'s data (and storage) with a copy of ``data``."""
        ...

    # -- tensors ----------------------------------------------------------------------
    def is_tensor(self, obj: object) -> bool: ...

    def is_parameter(self, obj: object) -> bool: ...

    def storage_of(self, tensor: Tensor) -> StorageRef:
        """The storage ``tensor`` is a view of; :data:`NO_STORAGE` for a tensor without
        one the swap layer could name (torch's sparse and other non-strided layouts): a
        saved tensor of that kind is left to the graph, neither counted nor moved."""
        ...

    def view_key(self, tensor: Tensor, storage: StorageRef) -> ViewKey: ...

    def is_lazy_view(self, tensor: Tensor) -> bool:
        """Whether ``tensor``'s values are not just its bytes: the framework transforms
        them when they are read (torch's conjugate and negative bits, set by ``conj()``
        and ``.imag`` of a conjugated view without copying). Such a saved tensor stays on
        device: its bytes alone, restored, would give other values (and its
        :class:`ViewKey` equals that of the plain view of the same bytes)."""
        ...

    def storage_bytes(self, tensor: Tensor, start: int, nbytes: int) -> Tensor | None:
        """A 1-D ``uint8`` tensor over bytes ``[start, start + nbytes)`` of ``tensor``'s
        storage (counted from the storage's first byte), sharing its memory and keeping
        it alive: what a storage span is copied from. None where the framework cannot
        view those bytes through ``tensor`` (the storage then stays on device)."""
        ...

    def host_bytes(self, tensor: Tensor, start: int, nbytes: int) -> HostArray | None:
        """:meth:`storage_bytes` for a tensor in host memory, as a 1-D ``uint8`` numpy
        array sharing that memory and keeping it alive (what the CPU copy engine copies a
        span from); None where the framework cannot view those bytes through ``tensor``."""
        ...

    def host_views(self, block: HostArray, places: Sequence[tuple[int, ViewKey]]) -> list[Tensor]:
        """:meth:`views_of` for a restored span in host memory (a 1-D ``uint8`` numpy
        array): the views' tensors share ``block``'s memory."""
        ...

    def views_of(self, block: Tensor, places: Sequence[tuple[int, ViewKey]]) -> list[Tensor]:
        """For each ``(offset, key)``, a tensor ``offset`` bytes into ``block`` (a 1-D
        ``uint8`` tensor: a restored storage span) with ``key``'s shape, strides and
        dtype, sharing ``block``'s memory (one storage, where the framework has views):
        the saved views of one storage, rebuilt as views of its restored span."""
        ...

    def data_nbytes(self, tensor: Tensor) -> int:
        """Bytes of the view's own elements (what a copy moves)."""
        ...

    def shape_of(self, tensor: Tensor) -> tuple[int, ...]: ...

    def version_of(self, tensor: Tensor) -> int | None:
        """The framework's in-place modification counter, or None if it has none that
        works (MindSpore 2.10 never bumps ``_version``)."""
        ...

    def to_host(self, tensor: Tensor, *, copy: bool) -> HostArray:
        """The tensor's data as a numpy array; ``copy=False`` may return a view."""
        ...

    def from_host(self, array: HostArray, like: Tensor | None = None) -> Tensor:
        """A tensor holding ``array``'s data on ``like``'s device (host memory when None;
        on the host it may share ``array``'s memory)."""
        ...

    def to_payload(self, tensor: Tensor, *, copy: bool, host: bool) -> Any:
        """What a P2P message carries for ``tensor``: a numpy array when ``host`` (the
        transport moves host memory), else whatever this framework passes between ranks
        of one process (a detached tensor); a copy when ``copy``."""
        ...

    def from_payload(self, payload: Any, like: Tensor | None) -> Tensor:
        """The tensor a received payload (or a micro-batch) becomes, on ``like``'s device."""
        ...

    def device_of(self, module: Module) -> str:
        """Where a module's parameters live (``"cpu"``, ``"cuda:0"``)."""
        ...

    def keep_scalar(self, value: Tensor) -> Any:
        """A run's 0-d result (a micro-batch's loss) as the run keeps it until its end,
        without waiting for the device (torch: the tensor, detached, where it is);
        :meth:`host_floats` turns what it kept into floats."""
        ...

    def host_floats(self, values: Sequence[Any]) -> list[float]:
        """What :meth:`keep_scalar` returned, as floats, in order: at the end of a run, in
        one transfer per device."""
        ...

    def scalar_like(self, value: float, like: Tensor) -> Tensor:
        """A 0-d tensor of ``like``'s dtype and device holding ``value``."""
        ...

    def zeros_like(self, tensor: Tensor) -> Tensor: ...

    def give_grads(self, params: Sequence[Tensor], grads: Sequence[Tensor | None]) -> None:
        """After a training run: each gradient (None: the parameter got none) where the
        framework's optimizers read it, as its own backward leaves it (torch: added into
        ``param.grad``, set where that is None). ``params`` lists every stage's of this
        process and may repeat a parameter that several stages share (tied weights): it
        then gets the sum, and no gradient passed in is changed (they are the stages' own
        ``stage.grads``). A no-op where optimizers take the gradients as an argument
        (MindSpore: ``stage.grads``)."""
        ...

    def add_into(self, total: Tensor, addend: Tensor) -> Tensor:
        """``total + addend``. ``total`` is a sum the caller made and nothing else refers
        to, so a backend may add in place and return it (torch); the result must be
        bit-identical to ``total + addend``."""
        ...

    def numpy_dtype(self, obj: object) -> np.dtype[Any] | None:
        """The numpy dtype of a tensor or array (None when numpy has no such dtype)."""
        ...

    # -- capture ------------------------------------------------------------------------
    def saved_tensors_hooks(
        self, pack: PackHook, unpack: UnpackHook
    ) -> AbstractContextManager[None]: ...

    def run_seed(self) -> int:
        """The seed of a run's stage streams: one draw from the framework's default
        generator, once per run (0, drawing nothing, where ``rng_scope`` is a no-op)."""
        ...

    def rng_scope(self, stream: RngStream, device: str) -> AbstractContextManager[None]:
        """Run the block (a stage's forward on ``device``) drawing its random numbers from
        ``stream`` instead of the process's generators, and keep what it drew there; the
        process's generators are as they were after it. A no-op where the framework's
        random ops do not depend on the order of other forwards."""
        ...

    def foreign_saved_tensors_hooks(self) -> bool:
        """Whether saved-tensor hooks other than ppswap's are the innermost active ones now
        (activation checkpointing's, a user's): a ``swap_wrapper`` region then leaves its
        saved tensors to them. False where the framework does not say."""
        ...

    def forward_context(self) -> object:
        """What a re-run of the forward starting now must reproduce (a recompute-wrapped
        block's, ``ppswap.swap.recompute``): the generator states its random ops draw
        from, and the framework's mixed-precision settings where it has them."""
        ...

    def rerun_forward(
        self, call: Callable[[], Any], context: object, pack: Callable[[Tensor], None]
    ) -> None:
        """Run ``call()`` again under ``context`` (``forward_context``) with gradient
        recording on, every tensor its graph saves handed to ``pack``, detached, in the
        order the graph saves them; the output and its graph are dropped, and the
        process's generators are as they were before, after."""
        ...

    # -- the run ------------------------------------------------------------------------
    def check_runnable(self) -> None:
        """Raise ValueError if the framework is configured so a pipeline cannot run."""
        ...

    def run_scope(self) -> AbstractContextManager[None]:
        """Entered around a run, before its first framework call and until its last
        (settings the framework needs while a run executes, restored after it)."""
        ...

    def caller_forward_scope(self, devices: Sequence[str]) -> ForwardScope:
        """Called on the thread that calls ``run_schedule``, when the run starts: that
        thread's settings which a forward on ``devices`` (``device_of``) depends on and the
        compute thread does not share, as the scope each forward and loss then runs in
        (torch: ``torch.autocast`` and the current CUDA device, per thread; a scope that
        sets nothing where there is none)."""
        ...

    def memory(self) -> DeviceMemory: ...

    def reset_peak_memory(self) -> None: ...

    def copy_engine(self, device: str = "cpu") -> CopyEngine:
        """The default copy engine for stages on ``device`` (``device_of``)."""
        ...
