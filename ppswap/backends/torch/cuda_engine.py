"""The CUDA copy engine: saved activations of CUDA tensors to page-locked host memory and
back, on a copy stream of their own.

- Each engine owns one CUDA stream for its copies (a run uses one engine: the one given
  as ``device``, or the one its first stage keeps across runs; every copy of every rank
  runs on that stream, in the FIFO order of the ranks' copy threads).
- ``span_sources`` (compute thread, when the chunk's forward ends) records one event on
  the compute stream after the chunk's tensors were produced; each copy waits for it on
  the copy stream (``Stream.wait_event``), so the copy never reads a half-computed
  activation and the compute stream never waits for a copy.
- ``d2h_many`` (copy thread) copies every span of an offload job into page-locked buffers
  from a pool (``torch.empty(..., pin_memory=True)``, handed out as numpy views: the swap
  layer's bucket layout and checks work on them) or into slices of a bucket, with
  ``non_blocking=True``, and waits once on that thread (one event on the copy stream
  after the last copy), so the job's completion means the bytes are on the host.
- What moves is a storage span (``ppswap/swap/spans.py``): the source is a ``uint8``
  tensor over the bytes of a storage its saved views use (``TorchBackend.storage_bytes``),
  the host copy one ``uint8`` buffer, the destination one ``uint8`` block.
- ``h2d_block`` (copy thread) allocates one block for a load job's spans on the copy
  stream, copies each to its offset and waits once.
- ``h2d`` (copy thread) allocates the destination on the copy stream (with the given
  strides, if any), copies and waits; ``restore_views`` (compute thread) marks the block
  as used by the compute stream (``record_stream``): the caching allocator then never
  hands its memory to the copy stream while compute kernels may still read it. The saved
  views are rebuilt on the restored block with ``set_`` (``TorchBackend.views_of``), so
  they share its storage and allocation, and with it that mark. A bucket's spans are slices of
  its one loaded block (``member``).
- A tensor the engine cannot move (a CPU tensor a CUDA stage saved, such as an RNG state)
  stays where it is (``can_move``).
- Device memory of an offloaded tensor is released when the swap layer drops its last
  reference after the offload completed (the copy stream is done reading it by then).

dtypes: host buffers are numpy views, so a dtype numpy has no type for (bfloat16) travels
as 16-bit integers and is viewed back by name (``ViewKey.dtype``) on the way in (the swap
layer moves spans as bytes and rebuilds the views by that name).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ppswap.backends.base import Backend, CopyEngine, ViewKey
from ppswap.backends.host_memory import CopyCounters, HostPool, PoolStats
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
    ready: torch.cuda.Event

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def dtype(self) -> np.dtype[Any]:
        return np.dtype(str(_carrier(self.tensor.dtype)).removeprefix("torch."))

    @property
    def nbytes(self) -> int:
        return int(self.tensor.numel() * self.tensor.element_size())


def _pinned_buffer(nbytes: int) -> HostArray:
    buffer: HostArray = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()
    return buffer


class CudaCopyEngine:
    """:class:`~ppswap.backends.base.CopyEngine` for CUDA tensors (module docstring)."""

    pinned = True

    def __init__(self, device: torch.device, *, max_pool_bytes: int | None = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pool = HostPool(max_pool_bytes, allocate=_pinned_buffer)
        self._backend: Backend | None = None

    def __repr__(self) -> str:
        return f"CudaCopyEngine({self.device})"

    def for_backend(self, backend: Backend) -> CopyEngine:
        """This engine bound to ``backend`` (the torch backend, which reads the spans and
        rebuilds the views); the stream, pool and counters are shared."""
        if backend.name != "torch":
            raise ValueError(f"the CUDA engine copies torch tensors, got backend {backend.name}")
        if self._backend is backend:
            return self
        bound = copy.copy(self)  # a shallow copy: the same stream and pool
        bound._backend = backend
        return bound

    def _bound(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(f"{self!r} is not bound to the torch backend: call for_backend")
        return self._backend

    # -- pool ---------------------------------------------------------------------------
    def acquire_host(self, nbytes: int) -> HostArray:
        return self.pool.acquire(nbytes)

    def release_host(self, buf: HostArray) -> None:
        self.pool.release(buf)

    def pool_stats(self) -> PoolStats:
        return self.pool.stats()

    def counters(self) -> CopyCounters:
        return self.pool.counters()

    # -- compute thread -------------------------------------------------------------------
    def can_move(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    def span_sources(
        self, spans: Sequence[tuple[torch.Tensor, int, int]]
    ) -> list[CudaSource | None]:
        # One event per device on the compute stream for all the chunk's spans: they were
        # all produced by the forward that just ended.
        backend = self._bound()
        events: dict[torch.device, torch.cuda.Event] = {}
        sources: list[CudaSource | None] = []
        for tensor, start, nbytes in spans:
            ready = events.get(tensor.device)
            if ready is None:
                ready = events[tensor.device] = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(tensor.device))
            data = backend.storage_bytes(tensor, start, nbytes)
            sources.append(None if data is None else CudaSource(data, ready))
        return sources

    def restore_views(
        self, loaded: torch.Tensor, places: Sequence[tuple[int, ViewKey]]
    ) -> list[torch.Tensor]:
        # The copy is complete (h2d waited for it); the block was allocated on the copy
        # stream and is now used on this thread's (compute) stream: tell the caching
        # allocator, so its memory is not reused before the compute stream is done with it.
        loaded.record_stream(torch.cuda.current_stream(loaded.device))
        return self._bound().views_of(loaded, places)

    def host_view(self, loaded: Any) -> HostArray | None:
        return loaded if isinstance(loaded, np.ndarray) else None

    def load_now(
        self, host: HostArray, strides: tuple[int, ...] | None = None, dtype: str | None = None
    ) -> torch.Tensor:
        fresh = self._empty_like(host, strides, dtype)
        fresh.copy_(self._typed(host, dtype))
        return fresh

    # -- copy thread ---------------------------------------------------------------------
    def d2h_many(
        self, sources: Sequence[CudaSource], into: Sequence[HostArray | None] | None = None
    ) -> list[HostArray]:
        targets = [None] * len(sources) if into is None else into
        if len(targets) != len(sources):
            raise ValueError(f"d2h_many: {len(sources)} sources but {len(targets)} targets")
        hosts: list[HostArray] = []
        taken: list[HostArray] = []
        waited: set[int] = set()
        total = 0
        try:
            with torch.cuda.stream(self.stream):
                for source, target in zip(sources, targets, strict=True):
                    if id(source.ready) not in waited:  # one event per chunk (span_sources)
                        self.stream.wait_event(source.ready)
                        waited.add(id(source.ready))
                    if target is None:
                        target = self.acquire_host(source.nbytes)
                        taken.append(target)
                    elif target.nbytes != source.nbytes:
                        raise ValueError(
                            f"d2h_many: a target has {target.nbytes} bytes, its source "
                            f"{source.nbytes}"
                        )
                    torch.from_numpy(target).copy_(source.tensor, non_blocking=True)
                    hosts.append(target)
                    total += source.nbytes
                done = torch.cuda.Event()
                done.record(self.stream)
            done.synchronize()
        except BaseException:
            self.stream.synchronize()  # no copy still writes a buffer given back
            for dst in taken:
                self.release_host(dst)
            raise
        self.pool.count_d2h(total, len(hosts))
        return hosts

    def h2d_block(
        self, hosts: Sequence[HostArray], offsets: Sequence[int], nbytes: int
    ) -> list[torch.Tensor]:
        loaded: list[torch.Tensor] = []
        total = 0
        with torch.cuda.stream(self.stream):
            block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            for host, offset in zip(hosts, offsets, strict=True):
                span = block[offset : offset + host.nbytes]
                span.copy_(torch.from_numpy(host), non_blocking=True)
                loaded.append(span)
                total += int(host.nbytes)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
        self.pool.count_h2d(total, len(loaded))
        return loaded

    def h2d(
        self, host: HostArray, strides: tuple[int, ...] | None = None, dtype: str | None = None
    ) -> torch.Tensor:
        with torch.cuda.stream(self.stream):
            fresh = self._empty_like(host, strides, dtype)
            fresh.copy_(self._typed(host, dtype), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
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
        with torch.cuda.stream(self.stream):  # its own layout back: one more copy
            fresh = self._empty_like(host, strides, dtype)
            fresh.copy_(view)
            done = torch.cuda.Event()
            done.record(self.stream)
        done.synchronize()
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
        shape = tuple(host.shape)
        if strides is None:
            return torch.empty(shape, dtype=typed_dtype, device=self.device)
        return torch.empty_strided(shape, strides, dtype=typed_dtype, device=self.device)
