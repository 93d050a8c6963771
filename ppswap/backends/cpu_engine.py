"""The CPU copy engine: host memory stands in for the device (``EmulatedDevice``).

Where the stages' tensors live in host memory (MindSpore on CPU, torch CPU tensors), a
"device" tensor's bytes are reachable as a numpy array: ``span_sources`` takes those views
on the compute thread (the framework's call), the copy thread copies with a real ``numpy``
memcpy into pooled host buffers, and ``restore_views`` makes the views of a loaded span
framework tensors again (sharing its memory). The engine knows no framework itself: the
runtime binds it to the stages' backend with ``for_backend``.

With a bandwidth set, each copy takes at least ``nbytes / bandwidth`` seconds (it sleeps
the remainder), so overlap can be studied as on a PCIe link. Bandwidths are in gigabytes
per second (1 GB/s = 1e9 bytes/s).

Host buffers come from a pool shared by every binding of the engine and living as long as
it (so across runs): raw ``uint8`` buffers grouped by size class
(``ppswap.backends.host_memory``: the pool and the block cache live there), handed out as
typed views and returned with ``release_host``. Plain memory: ``pinned`` is False.

The "device" memory a load lands in is cached the way a device's caching allocator caches
it (:class:`BlockCache`): a loaded span is a block taken from a pool of the same size
classes, and it goes back to the pool when the last array or framework tensor using it is
gone. A load then writes into memory that is already mapped, instead of asking the
system for fresh pages (page faults) on every load and returning them when the backward
drops them (docs/swap.md has the measured cost).
"""

from __future__ import annotations

import copy
import math
import time
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from ppswap.backends import host_memory
from ppswap.backends.base import Backend, CopyEngine, ViewKey
from ppswap.backends.host_memory import (
    HOST_ALIGNMENT,
    Array,
    BlockCache,
    CopyCounters,
    HostPool,
    PoolStats,
)

__all__ = [
    "EmulatedDevice",
    "aligned_empty",
    "contiguous_strides",
    "fresh_array",
]


def __getattr__(name: str) -> Any:
    """``size_class`` moved to ``ppswap.backends.host_memory`` (with the pool); the old
    name still works, with a ``DeprecationWarning``."""
    if name == "size_class":
        warnings.warn(
            "ppswap.backends.cpu_engine.size_class moved to ppswap.backends.host_memory",
            DeprecationWarning,
            stacklevel=2,
        )
        return host_memory.size_class
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _validate_bandwidth(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a positive number of GB/s or None, got {value!r}")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number of GB/s, got {value!r}")
    return float(value)


class EmulatedDevice:
    """A CPU copy engine: real memcpy, optional bandwidth floor, pooled host buffers.

    ``EmulatedDevice(d2h_gbps=None, h2d_gbps=None, max_pool_bytes=None)``; every method is
    thread-safe. ``span_sources`` / ``restore_views`` need a binding to a backend
    (``for_backend``), which the runtime makes at the start of each run.
    """

    pinned = False

    def __init__(
        self,
        d2h_gbps: float | None = None,
        h2d_gbps: float | None = None,
        *,
        max_pool_bytes: int | None = None,
    ) -> None:
        self.d2h_gbps = _validate_bandwidth("d2h_gbps", d2h_gbps)
        self.h2d_gbps = _validate_bandwidth("h2d_gbps", h2d_gbps)
        self.pool = HostPool(max_pool_bytes)
        self.blocks = BlockCache(max_pool_bytes)
        self._backend: Backend | None = None

    @property
    def max_pool_bytes(self) -> int | None:
        return self.pool.max_pool_bytes

    def __repr__(self) -> str:
        return f"EmulatedDevice(d2h_gbps={self.d2h_gbps}, h2d_gbps={self.h2d_gbps})"

    def for_backend(self, backend: Backend) -> CopyEngine:
        """This engine bound to ``backend``'s tensors; the pool and counters are shared."""
        if self._backend is backend:
            return self
        bound = copy.copy(self)  # a shallow copy: the same pool (and a subclass's state)
        bound._backend = backend
        return bound

    # -- pool ---------------------------------------------------------------------------

    def acquire_host(self, nbytes: int) -> Array:
        return self.pool.acquire(nbytes)

    def release_host(self, buf: Array) -> None:
        self.pool.release(buf)

    def clear_pool(self) -> None:
        """Free every idle host buffer and cached device block (those in use are
        unaffected)."""
        self.pool.clear()
        self.blocks.clear()

    def pool_stats(self) -> PoolStats:
        """The host buffer pool."""
        return self.pool.stats()

    def block_stats(self) -> PoolStats:
        """The cached device blocks loads land in (:class:`BlockCache`)."""
        return self.blocks.stats()

    def _fresh(self, like: Array, strides: tuple[int, ...] | None) -> Array:
        """Device memory for a load of ``like``: a cached block, or (another layout than
        C-contiguous) a plain allocation."""
        if strides is not None and tuple(strides) != contiguous_strides(like.shape):
            return fresh_array(like, strides)
        block: Array = self.blocks.empty(like.nbytes).view(like.dtype).reshape(like.shape)
        return block

    def counters(self) -> CopyCounters:
        return self.pool.counters()

    # -- framework side (compute thread) ---------------------------------------------------

    def _bound(self) -> Backend:
        if self._backend is None:
            raise RuntimeError(
                f"{self!r} is not bound to a tensor framework: call for_backend(backend)"
            )
        return self._backend

    def can_move(self, tensor: Any) -> bool:
        return True

    def check_devices(self, devices: Sequence[str]) -> None:
        """Accept stages on any devices: host memory stands in for each of them, and a
        tensor whose bytes the host cannot read stays where it is (``span_sources``)."""
        return None

    def span_sources(self, spans: Sequence[tuple[Any, int, int]]) -> list[Array | None]:
        """Each span's bytes as a ``uint8`` numpy view of its tensor's memory (no copy)."""
        backend = self._bound()
        return [backend.host_bytes(tensor, start, nbytes) for tensor, start, nbytes in spans]

    def restore_views(self, loaded: Array, places: Sequence[tuple[int, ViewKey]]) -> list[Any]:
        """The views' framework tensors, sharing ``loaded``'s memory."""
        return self._bound().host_views(loaded, places)

    def host_view(self, loaded: Array) -> Array:
        return loaded

    def load_now(
        self, host: Array, strides: tuple[int, ...] | None = None, dtype: str | None = None
    ) -> Array:
        """A plain copy on the calling thread (no bandwidth floor: not the copy stream)."""
        fresh = self._fresh(host, strides)
        np.copyto(fresh, host, casting="no")
        return fresh

    # -- copies (copy thread) --------------------------------------------------------------

    def d2h(self, src_view: Array) -> Array:
        raw = self.acquire_host(src_view.nbytes)
        dst: Array = raw.view(src_view.dtype).reshape(src_view.shape)
        self.d2h_into(src_view, dst)
        return dst

    def d2h_into(self, src_view: Array, dst: Array) -> None:
        if dst.nbytes != src_view.nbytes:
            raise ValueError(
                f"d2h_into: dst has {dst.nbytes} bytes, src_view has {src_view.nbytes}"
            )
        started = time.perf_counter()
        typed = dst.view(src_view.dtype).reshape(src_view.shape) if dst.nbytes else dst
        np.copyto(typed, src_view, casting="no")
        _throttle(src_view.nbytes, self.d2h_gbps, started)
        self.pool.count_d2h(src_view.nbytes)

    def d2h_many(
        self, sources: Sequence[Array], into: Sequence[Array | None] | None = None
    ) -> list[Array]:
        """Each source into its ``into`` slice or a pooled buffer of its own (the
        bandwidth floor applies to the bytes of all of them together, as one transfer)."""
        started = time.perf_counter()
        targets = [None] * len(sources) if into is None else into
        if len(targets) != len(sources):
            raise ValueError(f"d2h_many: {len(sources)} sources but {len(targets)} targets")
        acquire = self.acquire_host
        hosts: list[Array] = []
        taken: list[Array] = []
        total = 0
        try:
            for src, target in zip(sources, targets, strict=True):
                if target is None:
                    target = acquire(src.nbytes)
                    taken.append(target)
                elif target.nbytes != src.nbytes:
                    raise ValueError(
                        f"d2h_many: a target has {target.nbytes} bytes, its source {src.nbytes}"
                    )
                np.copyto(target, src, casting="no")  # both 1-D uint8 (span bytes)
                hosts.append(target)
                total += src.nbytes
        except BaseException:
            for dst in taken:
                self.release_host(dst)
            raise
        _throttle(total, self.d2h_gbps, started)
        self.pool.count_d2h(total, len(hosts))
        return hosts

    def h2d_block(self, hosts: Sequence[Array], offsets: Sequence[int], nbytes: int) -> list[Array]:
        """One cached block (:class:`BlockCache`) for all of ``hosts``."""
        if len(offsets) != len(hosts):
            raise ValueError(f"h2d_block: {len(hosts)} hosts but {len(offsets)} offsets")
        started = time.perf_counter()
        block = self.blocks.empty(nbytes)
        loaded: list[Array] = []
        total = 0
        for host, offset in zip(hosts, offsets, strict=True):
            end = offset + host.nbytes
            if offset < 0 or offset % HOST_ALIGNMENT or end > nbytes:
                raise ValueError(
                    f"h2d_block: a {host.nbytes}-byte span at offset {offset} does not fit "
                    f"a {nbytes}-byte block at a {HOST_ALIGNMENT}-byte boundary"
                )
            dst = block[offset:end]
            np.copyto(dst, host, casting="no")
            loaded.append(dst)
            total += host.nbytes
        _throttle(total, self.h2d_gbps, started)
        self.pool.count_h2d(total, len(loaded))
        return loaded

    def member(
        self,
        block: Array,
        offset: int,
        host: Array,
        strides: tuple[int, ...] | None = None,
        dtype: str | None = None,
    ) -> Array:
        loaded: Array = block[offset : offset + host.nbytes].view(host.dtype).reshape(host.shape)
        if strides is None or tuple(strides) == contiguous_strides(loaded.shape):
            return loaded
        return self.h2d(loaded, strides, dtype)  # its own layout back: one more copy

    def h2d(
        self, host: Array, strides: tuple[int, ...] | None = None, dtype: str | None = None
    ) -> Array:
        started = time.perf_counter()
        fresh = self._fresh(host, strides)
        np.copyto(fresh, host, casting="no")
        _throttle(host.nbytes, self.h2d_gbps, started)
        self.pool.count_h2d(host.nbytes)
        return fresh


def fresh_array(like: Array, strides: tuple[int, ...] | None) -> Array:
    """An uninitialised array of ``like``'s shape and dtype laid out with ``strides`` (in
    elements; None or C-contiguous ones: a plain contiguous array)."""
    shape = like.shape
    if strides is None or tuple(strides) == contiguous_strides(shape):
        return aligned_empty(shape, like.dtype)
    if any(n == 0 for n in shape):
        return np.empty(shape, dtype=like.dtype)
    span = 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))
    base = np.empty(span, dtype=like.dtype)
    byte_strides = tuple(s * like.itemsize for s in strides)
    fresh: Array = np.lib.stride_tricks.as_strided(base, shape=shape, strides=byte_strides)
    return fresh


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype[Any]) -> Array:
    """An uninitialised C-contiguous array starting at a :data:`HOST_ALIGNMENT` boundary,
    as device allocators hand out memory: the views rebuilt into a restored span then
    sit at the same alignment as before the offload."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize  # math.prod: np.prod costs ~15 us
    raw = np.empty(nbytes + HOST_ALIGNMENT, dtype=np.uint8)
    skip = -raw.ctypes.data % HOST_ALIGNMENT
    fresh: Array = raw[skip : skip + nbytes].view(dtype).reshape(shape)
    return fresh


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a C-contiguous array of ``shape``."""
    strides = []
    step = 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _throttle(nbytes: int, gbps: float | None, started: float) -> None:
    if gbps is None or nbytes == 0:
        return
    remaining = nbytes / (gbps * 1e9) - (time.perf_counter() - started)
    if remaining > 0:
        time.sleep(remaining)
