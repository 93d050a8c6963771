"""Copy engines: how bytes move between the "device" and the host tier.

On this machine the device is MindSpore's CPU memory and the host tier is numpy buffers
owned by the engine. A :class:`CopyEngine` is only ever called with numpy arrays and only
on the rank's copy thread (never the compute thread, never the event loop), except
:meth:`CopyEngine.release_host`, which is thread-safe and may be called from any thread.

:class:`EmulatedDevice` copies with a real ``numpy`` memcpy and, when a bandwidth is set,
makes each copy take at least ``nbytes / bandwidth`` seconds (it sleeps the remainder),
so overlap can be studied as on a PCIe link. Bandwidths are in gigabytes per second
(1 GB/s = 1e9 bytes/s).

Host buffers come from a pool that lives as long as the engine (so across runs): raw
``uint8`` buffers grouped by size class (the size rounded up to 1/8 of its power of two,
at least 4 KiB), handed out as typed views and returned with :meth:`release_host`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

__all__ = [
    "HOST_ALIGNMENT",
    "Array",
    "CopyCounters",
    "CopyEngine",
    "EmulatedDevice",
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


@runtime_checkable
class CopyEngine(Protocol):
    """What the swap runtime needs from a copy engine (see the module docstring)."""

    def d2h(self, src_view: Array) -> Array:
        """Copy ``src_view`` into a pooled host buffer; return it (same shape/dtype)."""
        ...

    def acquire_host(self, nbytes: int) -> Array:
        """A pooled host ``uint8`` buffer of at least ``nbytes`` (exactly ``nbytes`` long)."""
        ...

    def d2h_into(self, src_view: Array, dst: Array) -> None:
        """Copy ``src_view`` into ``dst`` (a slice of an acquired host buffer)."""
        ...

    def h2d(self, host: Array) -> Array:
        """Copy ``host`` into fresh "device" memory and return it (same shape/dtype)."""
        ...

    def release_host(self, buf: Array) -> None:
        """Give a buffer from :meth:`d2h`/:meth:`acquire_host` (or a view of it) back."""
        ...

    def pool_stats(self) -> PoolStats:
        """The host pool's state."""
        ...


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


class EmulatedDevice:
    """A CPU copy engine: real memcpy, optional bandwidth floor, pooled host buffers.

    ``max_pool_bytes`` caps the idle bytes the pool keeps (``None``: no cap); a released
    buffer that would exceed it is freed instead. All methods are thread-safe.
    """

    def __init__(
        self,
        d2h_gbps: float | None = None,
        h2d_gbps: float | None = None,
        *,
        max_pool_bytes: int | None = None,
    ) -> None:
        self.d2h_gbps = _validate_bandwidth("d2h_gbps", d2h_gbps)
        self.h2d_gbps = _validate_bandwidth("h2d_gbps", h2d_gbps)
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

    def __repr__(self) -> str:
        return f"EmulatedDevice(d2h_gbps={self.d2h_gbps}, h2d_gbps={self.h2d_gbps})"

    # -- pool ---------------------------------------------------------------------------

    def acquire_host(self, nbytes: int) -> Array:
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
            raw = np.empty(cls, dtype=np.uint8)
        with self._lock:
            self._lent[id(raw)] = raw
        return raw[:nbytes]

    def release_host(self, buf: Array) -> None:
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

    def clear_pool(self) -> None:
        """Free every idle buffer (lent buffers are unaffected)."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0

    def pool_stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                buffers=sum(len(v) for v in self._idle.values()),
                bytes_held=self._idle_bytes,
                lent=len(self._lent),
                bytes_lent=sum(b.nbytes for b in self._lent.values()),
                hits=self._hits,
                misses=self._misses,
            )

    def counters(self) -> CopyCounters:
        with self._lock:
            return CopyCounters(
                d2h_bytes=self._d2h_bytes,
                h2d_bytes=self._h2d_bytes,
                d2h_calls=self._d2h_calls,
                h2d_calls=self._h2d_calls,
            )

    # -- copies -------------------------------------------------------------------------

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
        self._throttle(src_view.nbytes, self.d2h_gbps, started)
        with self._lock:
            self._d2h_bytes += src_view.nbytes
            self._d2h_calls += 1

    def h2d(self, host: Array) -> Array:
        started = time.perf_counter()
        fresh = np.empty(host.shape, dtype=host.dtype)
        np.copyto(fresh, host, casting="no")
        self._throttle(host.nbytes, self.h2d_gbps, started)
        with self._lock:
            self._h2d_bytes += host.nbytes
            self._h2d_calls += 1
        return fresh

    @staticmethod
    def _throttle(nbytes: int, gbps: float | None, started: float) -> None:
        if gbps is None or nbytes == 0:
            return
        remaining = nbytes / (gbps * 1e9) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)
