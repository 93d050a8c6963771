"""Host memory of the copy engines: pooled host buffers and cached "device" blocks.

:class:`HostPool` lends raw ``uint8`` host buffers grouped by size class (the size rounded
up to 1/8 of its power of two, at least 4 KiB), takes them back with ``release``, and
keeps the engine's copy counters. A CUDA engine passes an ``allocate`` that makes
page-locked memory; the CPU engine uses plain memory.

:class:`BlockCache` is the "device" memory of the CPU engine (``ppswap.backends.cpu_engine``),
cached the way a device's caching allocator caches it: a block goes back to the cache by
itself once nothing uses it any more.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "HOST_ALIGNMENT",
    "Array",
    "BlockCache",
    "CopyCounters",
    "HostPool",
    "PoolStats",
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
