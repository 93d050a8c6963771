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
it (so across runs): raw ``uint8`` buffers grouped by size class (the size rounded up to
1/8 of its power of two, at least 4 KiB), handed out as typed views and returned with
``release_host``. Plain memory: ``pinned`` is False.

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
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ppswap.backends.base import Backend, CopyEngine, ViewKey

__all__ = [
    "HOST_ALIGNMENT",
    "Array",
    "BlockCache",
    "CopyCounters",
    "EmulatedDevice",
    "HostPool",
    "PoolStats",
    "aligned_empty",
    "contiguous_strides",
    "fresh_array",
    "size_class",
]

Array = npt.NDArray[Any]
"""A numpy array of any dtype (host buffers, numpy views of device tensors)."""

HOST_ALIGNMENT = 64
_MIN_CLASS = 4096


@dataclass(frozen=True)
class PoolStats:
    """State of a host buffer pool.

    ``buffers``/``bytes_held``: idle buffers in the pool and their bytes;
    ``lent``/``bytes_lent``: buffers handed out and not yet released;
    ``hits``/``misses``: acquisitions served from the pool / by a new allocation.
    """

    buffers: int
    bytes_held: int
    lent: int
    bytes_lent: int
    hits: int
    misses: int


@dataclass(frozen=True)
class CopyCounters:
    """Bytes and calls an engine has copied in each direction."""

    d2h_bytes: int
    h2d_bytes: int
    d2h_calls: int
    h2d_calls: int


def size_class(nbytes: int) -> int:
    """The pool size class of a request: ``nbytes`` rounded up to 1/8 of its power of 2."""
    if nbytes <= _MIN_CLASS:
        return _MIN_CLASS
    step = max(_MIN_CLASS, 1 << max(0, (nbytes - 1).bit_length() - 4))
    return -(-nbytes // step) * step


def _validate_bandwidth(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a positive number of GB/s or None, got {value!r}")
    if not value > 0 or value != value or value == float("inf"):
        raise ValueError(f"{name} must be a positive finite number of GB/s, got {value!r}")
    return float(value)


def _root(buf: Array) -> Array:
    root = buf
    while isinstance(root.base, np.ndarray):
        root = root.base
    return root


def _plain_buffer(nbytes: int) -> Array:
    return np.empty(nbytes, dtype=np.uint8)


class HostPool:
    """Pooled host buffers and the copy counters of an engine. Thread-safe.

    ``max_pool_bytes`` caps the idle bytes the pool keeps (``None``: no cap); a released
    buffer that would exceed it is freed instead. ``allocate(nbytes)`` makes a new
    ``uint8`` buffer (default plain memory; a CUDA engine passes page-locked memory).
    """

    def __init__(
        self,
        max_pool_bytes: int | None = None,
        allocate: Callable[[int], Array] | None = None,
    ) -> None:
        self._allocate = allocate if allocate is not None else _plain_buffer
        if max_pool_bytes is not None and (
            isinstance(max_pool_bytes, bool)
            or not isinstance(max_pool_bytes, int)
            or max_pool_bytes < 0
        ):
            raise ValueError(f"max_pool_bytes must be an int >= 0 or None, got {max_pool_bytes!r}")
        self.max_pool_bytes = max_pool_bytes
        self._lock = threading.Lock()
        self._idle: dict[int, list[Array]] = {}
        self._idle_bytes = 0
        self._lent: dict[int, Array] = {}
        self._hits = 0
        self._misses = 0
        self._d2h_bytes = 0
        self._h2d_bytes = 0
        self._d2h_calls = 0
        self._h2d_calls = 0

    def acquire(self, nbytes: int) -> Array:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        cls = size_class(nbytes)
        with self._lock:
            free = self._idle.get(cls)
            if free:
                raw = free.pop()
                self._idle_bytes -= raw.nbytes
                self._hits += 1
            else:
                raw = None
                self._misses += 1
        if raw is None:
            raw = self._allocate(cls)
        with self._lock:
            self._lent[id(raw)] = raw
        return raw[:nbytes]

    def release(self, buf: Array) -> None:
        raw = _root(buf)
        with self._lock:
            if self._lent.pop(id(raw), None) is None:
                raise ValueError(
                    "release_host(buf): buf is not a buffer lent by this engine "
                    "(already released, or from elsewhere)"
                )
            if self.max_pool_bytes is not None and (
                self._idle_bytes + raw.nbytes > self.max_pool_bytes
            ):
                return
            self._idle.setdefault(raw.nbytes, []).append(raw)
            self._idle_bytes += raw.nbytes

    def clear(self) -> None:
        """Free every idle buffer (lent buffers are unaffected)."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0

    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                buffers=sum(len(v) for v in self._idle.values()),
                bytes_held=self._idle_bytes,
                lent=len(self._lent),
                bytes_lent=sum(b.nbytes for b in self._lent.values()),
                hits=self._hits,
                misses=self._misses,
            )

    def count_d2h(self, nbytes: int, calls: int = 1) -> None:
        with self._lock:
            self._d2h_bytes += nbytes
            self._d2h_calls += calls

    def count_h2d(self, nbytes: int, calls: int = 1) -> None:
        with self._lock:
            self._h2d_bytes += nbytes
            self._h2d_calls += calls

    def counters(self) -> CopyCounters:
        with self._lock:
            return CopyCounters(
                d2h_bytes=self._d2h_bytes,
                h2d_bytes=self._h2d_bytes,
                d2h_calls=self._d2h_calls,
                h2d_calls=self._h2d_calls,
            )


class _Lease:
    """The owner of one cached block while it is in use: the arrays made from it (and
    the framework tensors made from those) keep it alive as their numpy ``base``; when
    the last of them is gone its block is handed back (to a deque: a finalizer may run
    on any thread, inside any lock, so it takes none)."""

    __slots__ = ("__array_interface__", "_raw", "_returned")

    def __init__(self, raw: Array, ptr: int, nbytes: int, returned: deque[Array]) -> None:
        self._raw = raw
        self._returned = returned
        self.__array_interface__ = {
            "data": (ptr, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }

    def __del__(self) -> None:
        self._returned.append(self._raw)


class BlockCache:
    """Cached "device" memory of a CPU engine, as a caching allocator keeps device memory.

    :meth:`empty` hands out a contiguous ``uint8`` array starting at a
    :data:`HOST_ALIGNMENT` boundary; its block returns to the cache by itself once
    nothing uses it any more (no release call: the framework's tensors decide when).
    ``max_idle_bytes`` caps the idle bytes kept (``None``: no cap). Thread-safe.
    """

    def __init__(self, max_idle_bytes: int | None = None) -> None:
        self._pool = HostPool(max_idle_bytes)
        self._returned: deque[Array] = deque()

    def empty(self, nbytes: int) -> Array:
        """An uninitialised block of ``nbytes`` bytes (see the class docstring)."""
        self._take_back()
        raw = self._pool.acquire(nbytes + HOST_ALIGNMENT)
        root = _root(raw)
        ptr = root.ctypes.data
        ptr += -ptr % HOST_ALIGNMENT
        block: Array = np.asarray(_Lease(root, ptr, nbytes, self._returned))
        return block

    def stats(self) -> PoolStats:
        """The cache as a pool: ``lent`` blocks are in use, ``buffers`` idle."""
        self._take_back()
        return self._pool.stats()

    def clear(self) -> None:
        """Free every idle block (blocks in use return to the cache when freed)."""
        self._take_back()
        self._pool.clear()

    def _take_back(self) -> None:
        returned = self._returned
        while True:
            try:
                raw = returned.popleft()
            except IndexError:
                return
            self._pool.release(raw)


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
