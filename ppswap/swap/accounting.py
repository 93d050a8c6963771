"""Device-memory accounting of saved tensors, shared by the compute and copy threads.

The unit of accounting is a *device block*: one piece of device memory that really
exists, counted once however many saved tensors (views) point into it.

- ``("storage", ptr)``: the storage a captured or ledger-only saved tensor lives in,
  identified by its base address; its size is the storage's ``nbytes()`` (the whole
  storage, because that is what stays allocated while any view of it is held).
- ``("loaded", n)``: memory allocated by a load (a restored tensor, or a restored
  bucket of a ``group_swap`` group); ``n`` is a fresh serial number, never an address,
  so a freed-and-reused address can never be confused with a live block.

A block is *held* by one or more holders (a chunk's ledger record, a swap entry in a
device-resident state); it counts toward ``resident_bytes`` while at least one holder
holds it. Each holder belongs to a chunk ``(stage, micro)``, so the accounting can also
answer "is this storage held on device by another chunk?" (cross-chunk sharing).

``peak_bytes`` is the maximum of ``resident_bytes`` seen at any increase. All methods are
thread-safe (one lock); none of them blocks on anything else.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

__all__ = ["Chunk", "DeviceBlock", "SwapAccounting", "UnpackCounters", "storage_block"]

Chunk = tuple[int, int]
DeviceBlock = tuple[str, int]


def storage_block(ptr: int) -> DeviceBlock:
    """The block of the storage at base address ``ptr`` (module docstring)."""
    return ("storage", ptr)


@dataclass(frozen=True)
class UnpackCounters:
    """How often backward's unpack had to use the safety net.

    ``waited_loads``: the load was launched but not finished, unpack waited for it.
    ``sync_loads``: the load was never launched, unpack loaded synchronously.
    ``device_fallbacks``: the offload was in flight, unpack used the live device tensor.
    """

    waited_loads: int = 0
    sync_loads: int = 0
    device_fallbacks: int = 0


class SwapAccounting:
    """Resident/peak device bytes of saved tensors plus the byte and unpack counters."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Per block held: its holders (each with its chunk) and its size. Two dicts, not a
        # record object per block: a block lives from its chunk's forward to its backward,
        # and every object that lives that long adds to the garbage collector's passes.
        self._blocks: dict[DeviceBlock, dict[Hashable, Chunk]] = {}
        self._block_bytes: dict[DeviceBlock, int] = {}
        self._resident = 0
        self._peak = 0
        self._offloaded = 0
        self._loaded = 0
        self._waited_loads = 0
        self._sync_loads = 0
        self._device_fallbacks = 0
        self._serial = itertools.count(1)

    def new_loaded_block(self) -> DeviceBlock:
        """A fresh block id for memory that a load is about to allocate (no lock: one
        ``next`` of an ``itertools.count`` is atomic in CPython)."""
        return ("loaded", next(self._serial))

    def hold(self, block: DeviceBlock, nbytes: int, holder: Hashable, chunk: Chunk) -> None:
        """``holder`` (of ``chunk``) keeps ``block`` of ``nbytes`` alive on device."""
        with self._lock:
            self._hold(block, nbytes, (holder,), chunk)

    def hold_all(
        self, block: DeviceBlock, nbytes: int, holders: Iterable[Hashable], chunk: Chunk
    ) -> None:
        """Each of ``holders`` (of ``chunk``) keeps ``block`` of ``nbytes`` alive on device
        (one lock for all of them)."""
        with self._lock:
            self._hold(block, nbytes, holders, chunk)

    def _hold(
        self, block: DeviceBlock, nbytes: int, holders: Iterable[Hashable], chunk: Chunk
    ) -> None:
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        held = self._blocks.get(block)
        if held is None:
            held = self._blocks[block] = {}
            self._block_bytes[block] = nbytes
            self._resident += nbytes
            if self._resident > self._peak:
                self._peak = self._resident
        for holder in holders:
            held[holder] = chunk

    def hold_blocks(
        self, blocks: Iterable[tuple[DeviceBlock, int, Iterable[Hashable]]], chunk: Chunk
    ) -> None:
        """:meth:`hold_all` for each ``(block, nbytes, holders)``, under one lock."""
        with self._lock:
            for block, nbytes, holders in blocks:
                self._hold(block, nbytes, holders, chunk)

    def drop(self, block: DeviceBlock, holder: Hashable) -> None:
        """``holder`` no longer keeps ``block`` alive; unknown pairs are ignored."""
        with self._lock:
            self._drop(block, holder)

    def drop_all(self, pairs: Iterable[tuple[DeviceBlock, Hashable]]) -> None:
        """:meth:`drop` for each ``(block, holder)`` pair, under one lock."""
        with self._lock:
            for block, holder in pairs:
                self._drop(block, holder)

    def _drop(self, block: DeviceBlock, holder: Hashable) -> None:
        held = self._blocks.get(block)
        if held is None or holder not in held:
            return
        del held[holder]
        if not held:
            del self._blocks[block]
            self._resident -= self._block_bytes.pop(block)

    def chunks_holding(self, block: DeviceBlock) -> frozenset[Chunk]:
        """The chunks that currently hold ``block`` on device."""
        with self._lock:
            held = self._blocks.get(block)
            return frozenset(held.values()) if held else frozenset()

    def is_held(self, block: DeviceBlock) -> bool:
        """Whether any holder holds ``block`` on device (one dict lookup, atomic under the
        GIL: no lock)."""
        return block in self._blocks

    def held_by_other_chunk(self, block: DeviceBlock, chunk: Chunk) -> bool:
        """Whether a chunk other than ``chunk`` holds ``block`` on device."""
        if block not in self._blocks:  # the common case, asked once per saved tensor: one
            return False  # dict lookup (atomic under the GIL), no lock
        with self._lock:
            held = self._blocks.get(block)
            return held is not None and any(c != chunk for c in held.values())

    def chunk_bytes(self, chunk: Chunk) -> int:
        """The bytes of the blocks some holder of ``chunk`` holds on device now (a block
        shared with other chunks counted in full): what the chunk keeps resident."""
        with self._lock:
            return sum(
                self._block_bytes[block]
                for block, held in self._blocks.items()
                if chunk in held.values()
            )

    def add_offloaded(self, nbytes: int) -> None:
        with self._lock:
            self._offloaded += nbytes

    def add_loaded(self, nbytes: int) -> None:
        with self._lock:
            self._loaded += nbytes

    def count_waited_load(self) -> None:
        with self._lock:
            self._waited_loads += 1

    def count_sync_load(self) -> None:
        with self._lock:
            self._sync_loads += 1

    def count_device_fallback(self) -> None:
        with self._lock:
            self._device_fallbacks += 1

    @property
    def resident_bytes(self) -> int:
        with self._lock:
            return self._resident

    @property
    def peak_bytes(self) -> int:
        with self._lock:
            return self._peak

    @property
    def offloaded_bytes(self) -> int:
        with self._lock:
            return self._offloaded

    @property
    def loaded_bytes(self) -> int:
        with self._lock:
            return self._loaded

    @property
    def block_count(self) -> int:
        with self._lock:
            return len(self._blocks)

    def unpack_counters(self) -> UnpackCounters:
        with self._lock:
            return UnpackCounters(
                waited_loads=self._waited_loads,
                sync_loads=self._sync_loads,
                device_fallbacks=self._device_fallbacks,
            )
