"""The CUDA copy engine: saved activations of CUDA tensors to page-locked host memory and
back, on copy streams of their own.

- One engine serves one device (``device``): it moves only tensors on that device
  (``can_move``), and a run with swap whose stages are on several CUDA devices is
  refused before it starts (``check_devices``: the message names the devices). A
  CPU tensor a CUDA stage saved (an RNG state) stays where it is too.
- Streams: each copy thread gets a D2H stream and an H2D stream of its own, kept by the
  thread's name (a rank's offload and load threads: ``ppswap.actors.copy_stream``), so a
  load never queues behind an unrelated offload on the device, and a rank's streams
  (and the blocks the caching allocator keeps for them) serve the next run too.
- ``span_sources`` (compute thread, when the chunk's forward ends) records one event on
  the compute stream after the chunk's tensors were produced; the D2H stream waits for it
  (``wait_event``) before the chunk's first copy, so a copy never reads a half-computed
  activation and the compute stream never waits for a copy.
- ``d2h_many`` (copy thread) copies every span of an offload job into page-locked buffers
  from a pool (handed out as numpy views: the swap layer's bucket layout and checks work
  on them) or into slices of a bucket, with ``non_blocking=True``, and waits once (one
  blocking event after the last copy), so the job's completion means the bytes are on
  the host; only then can a buffer go back to the pool and be handed out again.
- What moves is a storage span (``ppswap/swap/spans.py``): the source is a ``uint8``
  tensor over the bytes of a storage its saved views use (``TorchBackend.storage_bytes``),
  the host copy one ``uint8`` buffer, the destination one ``uint8`` block.
- ``h2d_block`` / ``h2d`` (copy thread) allocate the destination on the H2D stream, copy
  and wait once, so the host buffers can go back to the pool; ``restore_views`` (compute
  thread) marks the block as used by the compute stream (``record_stream``): the caching
  allocator then never hands its memory to the copy stream while compute kernels may
  still read it. The saved views are rebuilt on the restored block with ``set_``
  (``TorchBackend.views_of``), so they share its storage and allocation, and with it
  that mark. A bucket's spans are slices of its one loaded block (``member``).
- Device memory of an offloaded tensor is released when the swap layer drops its last
  reference after the offload completed (the copy stream is done reading it by then).
- Every device call goes through a :class:`~ppswap.backends.torch.cuda_api.CudaApi`
  (``api``; default ``torch.cuda``), which a test replaces with a fake device on CPU.

dtypes: host buffers are numpy views, so a dtype numpy has no type for (bfloat16) travels
as 16-bit integers and is viewed back by name (``ViewKey.dtype``) on the way in (the swap
layer moves spans as bytes and rebuilds the views by that name).
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ppswap.backends.base import Backend, CopyEngine, ViewKey
from ppswap.backends.host_memory import CopyCounters, HostPool, PoolStats
from ppswap.backends.torch.cuda_api import CudaApi, TorchCuda
from ppswap.backends.types import HostArray

__all__ = ["CudaCopyEngine", "CudaSource"]

_CARRIERS = {
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e5m2: torch.uint8,
}
_BY_NAME = {str(dtype): dtype for dtype in (*_CARRIERS, torch.float16, torch.float32)}


def _carrier(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor's bytes travel as through numpy."""
    return _CARRIERS.get(dtype, dtype)


@dataclass(frozen=True, slots=True)
class CudaSource:
    """A CUDA tensor to copy out and the compute-stream event it was produced by. Shaped
    like a numpy array (``shape``, ``dtype``, ``nbytes``) for the swap layer's layout."""

    tensor: torch.Tensor
    ready: Any  # an event of the engine's CudaApi

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(str(_carrier(self.tensor.dtype)).removeprefix("torch."))

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel() * self.tensor.element_size())


class _Streams:
    """The copy streams of one engine: per copy thread (by name) and direction, made on
    first use and kept (shared by every binding of the engine)."""

    def __init__(self, api: CudaApi, device: torch.device) -> None:
        self._api = api
        self._device = device
        self._lock = threading.Lock()
        self._made: dict[tuple[str, str], Any] = {}

    def of_this_thread(self, direction: str) -> Any:
        key = (threading.current_thread().name, direction)
        with self._lock:
            stream = self._made.get(key)
            if stream is None:
                stream = self._made[key] = self._api.new_stream(self._device)
            return stream

    def all(self) -> list[Any]:
        with self._lock:
            return list(self._made.values())


class CudaCopyEngine:
    """:class:`~ppswap.backends.base.CopyEngine` for the CUDA tensors of one device
    (module docstring). ``device``: a CUDA device (``cuda`` without an index means
    ``cuda:0``); ``api``: the device calls (default ``torch.cuda``)."""

    pinned = True

    def __init__(
        self,
        device: torch.device | str,
        *,
        max_pool_bytes: int | None = None,
        api: CudaApi | None = None,
    ) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        self.device = device if device.index is not None else torch.device("cuda", 0)
        self.api: CudaApi = api if api is not None else TorchCuda()
        self.pool = HostPool(max_pool_bytes, allocate=self.api.pinned_empty)
        self.streams = _Streams(self.api, self.device)
        self._backend: Backend | None = None

    def __repr__(self) -> str:
        return f"CudaCopyEngine({self.device})"

    def for_backend(self, backend: Backend) -> CopyEngine:
        """This engine bound to ``backend`` (the torch backend, which reads the spans and
        rebuilds the views); the streams, pool and counters are shared."""
        if backend.name != "torch":
            raise ValueError(f"the CUDA engine copies torch tensors, got backend {backend.name}")
        if self._backend is backend:
            return self
        bound = copy.copy(self)  # a shallow copy: the same streams and pool
        bound._backend = backend
        return bound

    def _bound(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(f"{self!r} is not bound to the torch backend: call for_backend")
        return self._backend

    def check_devices(self, devices: Sequence[str]) -> None:
        """Refuse (ValueError, one line naming them) stages on a CUDA device other than
        this engine's: one engine moves the tensors of one device."""
        others = sorted({str(torch.device(d)) for d in devices} - {str(self.device)})
        cuda_others = [d for d in others if d.startswith("cuda")]
        if cuda_others:
            named = ", ".join(sorted({str(self.device), *cuda_others}))
            raise ValueError(
                f"swap with stages on several CUDA devices in one process ({named}) is not "
                f"supported: {self!r} moves the activations of {self.device} only; run one "
                "process per device (a distributed transport) or keep every stage on one "
                "device"
            )

    # -- pool ---------------------------------------------------------------------------
    def acquire_host(self, nbytes: int) -> HostArray:
        return self.pool.acquire(nbytes)

    def release_host(self, buf: HostArray) -> None:
        self.pool.release(buf)

    def clear_pool(self) -> None:
        """Free every idle page-locked host buffer (those in use are unaffected). Device
        blocks are the caching allocator's (``torch.cuda.empty_cache``)."""
        self.pool.clear()

    def pool_stats(self) -> PoolStats:
        """The page-locked host buffer pool."""
        return self.pool.stats()

    def counters(self) -> CopyCounters:
        return self.pool.counters()

    # -- compute thread -------------------------------------------------------------------
    def can_move(self, tensor: torch.Tensor) -> bool:
        return self.api.device_of(tensor) == self.device

    def span_sources(
        self, spans: Sequence[tuple[torch.Tensor, int, int]]
    ) -> list[CudaSource | None]:
        # One event on the compute stream for all the chunk's spans: they were all
        # produced by the forward that just ended.
        backend, api = self._bound(), self.api
        ready = None
        sources: list[CudaSource | None] = []
        for tensor, start, nbytes in spans:
            if api.device_of(tensor) != self.device:
                raise ValueError(
                    f"{self!r} cannot move a tensor on {api.device_of(tensor)} "
                    "(can_move says which it moves)"
                )
            if ready is None:
                ready = api.new_event()
                api.record(ready, api.current_stream(self.device))
            data = backend.storage_bytes(tensor, start, nbytes)
            sources.append(None if data is None else CudaSource(data, ready))
        return sources

    def restore_views(
        self, loaded: torch.Tensor, places: Sequence[tuple[int, ViewKey]]
    ) -> list[torch.Tensor]:
        # The copy is complete (the H2D stream was waited for); the block was allocated
        # on that stream and is now used on this thread's (compute) stream: tell the
        # caching allocator, so its memory is not reused before the compute stream is
        # done with it.
        self.api.record_stream(loaded, self.api.current_stream(self.device))
        return self._bound().views_of(loaded, places)

    def host_view(self, loaded: Any) -> HostArray | None:
        return loaded if isinstance(loaded, np.ndarray) else None

    def load_now(
        self, host: HostArray, strides: tuple[int, ...] | None = None, dtype: str | None = None
    ) -> torch.Tensor:
        fresh = self._empty_like(host, strides, dtype)
        self.api.copy(fresh, self._typed(host, dtype), non_blocking=False)
        return fresh

    # -- copy thread ---------------------------------------------------------------------
    def d2h_many(
        self, sources: Sequence[CudaSource], into: Sequence[HostArray | None] | None = None
    ) -> list[HostArray]:
        targets = [None] * len(sources) if into is None else into
        if len(targets) != len(sources):
            raise ValueError(f"d2h_many: {len(sources)} sources but {len(targets)} targets")
        api = self.api
        stream = self.streams.of_this_thread("d2h")
        hosts: list[HostArray] = []
        taken: list[HostArray] = []
        waited: set[int] = set()
        total = 0
        try:
            with api.use_stream(stream):
                for source, target in zip(sources, targets, strict=True):
                    if id(source.ready) not in waited:  # one event per chunk (span_sources)
                        api.wait_event(stream, source.ready)
                        waited.add(id(source.ready))
                    if target is None:
                        target = self.acquire_host(source.nbytes)
                        taken.append(target)
                    elif target.nbytes != source.nbytes:
                        raise ValueError(
                            f"d2h_many: a target has {target.nbytes} bytes, its source "
                            f"{source.nbytes}"
                        )
                    api.copy(torch.from_numpy(target), source.tensor, non_blocking=True)
                    hosts.append(target)
                    total += source.nbytes
                done = api.new_event()
                api.record(done, stream)
            api.synchronize_event(done)
        except BaseException:
            api.synchronize_stream(stream)  # no copy still writes a buffer given back
            for dst in taken:
                self.release_host(dst)
            raise
        self.pool.count_d2h(total, len(hosts))
        return hosts

    def h2d_block(
        self, hosts: Sequence[HostArray], offsets: Sequence[int], nbytes: int
    ) -> list[torch.Tensor]:
        api = self.api
        stream = self.streams.of_this_thread("h2d")
        loaded: list[torch.Tensor] = []
        total = 0
        try:
            with api.use_stream(stream):
                block = api.empty((nbytes,), torch.uint8, self.device)
                for host, offset in zip(hosts, offsets, strict=True):
                    span = block[offset : offset + host.nbytes]
                    api.copy(span, torch.from_numpy(host), non_blocking=True)
                    loaded.append(span)
                    total += int(host.nbytes)
                done = api.new_event()
                api.record(done, stream)
            api.synchronize_event(done)  # the host buffers may go back to the pool now
        except BaseException:
            api.synchronize_stream(stream)
            raise
        self.pool.count_h2d(total, len(loaded))
        return loaded

    def h2d(
        self, host: HostArray, strides: tuple[int, ...] | None = None, dtype: str | None = None
    ) -> torch.Tensor:
        api = self.api
        stream = self.streams.of_this_thread("h2d")
        try:
            with api.use_stream(stream):
                fresh = self._empty_like(host, strides, dtype)
                api.copy(fresh, self._typed(host, dtype), non_blocking=True)
                done = api.new_event()
                api.record(done, stream)
            api.synchronize_event(done)
        except BaseException:
            api.synchronize_stream(stream)
            raise
        self.pool.count_h2d(int(host.nbytes))
        return fresh

    def member(
        self,
        block: torch.Tensor,
        offset: int,
        host: HostArray,
        strides: tuple[int, ...] | None = None,
        dtype: str | None = None,
    ) -> torch.Tensor:
        typed_dtype = self._typed(host[:0] if host.ndim else host, dtype).dtype
        raw = block[offset : offset + host.nbytes]
        view = raw.view(typed_dtype).reshape(tuple(host.shape))
        if strides is None or tuple(view.stride()) == tuple(strides):
            return view
        api = self.api
        stream = self.streams.of_this_thread("h2d")
        with api.use_stream(stream):  # its own layout back: one more copy
            fresh = self._empty_like(host, strides, dtype)
            api.copy(fresh, view, non_blocking=True)
            done = api.new_event()
            api.record(done, stream)
        api.synchronize_event(done)
        return fresh

    # -- helpers -------------------------------------------------------------------------
    def _typed(self, host: HostArray, dtype: str | None) -> torch.Tensor:
        """The host array as a torch CPU tensor of the original dtype (shared memory)."""
        tensor = torch.from_numpy(host)
        original = _BY_NAME.get(dtype or "")
        if original is not None and original in _CARRIERS:
            return tensor.view(original)
        return tensor

    def _empty_like(
        self, host: HostArray, strides: tuple[int, ...] | None, dtype: str | None
    ) -> torch.Tensor:
        typed_dtype = self._typed(host[:0] if host.ndim else host, dtype).dtype
        return self.api.empty(tuple(host.shape), typed_dtype, self.device, strides)
