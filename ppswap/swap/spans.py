"""Storage spans: what a group's copies move, one per storage.

Autograd saves views, and several saved views can share one storage: ``q, k, v =
qkv.unbind(0)`` (three views at offsets), ``k.transpose(1, 2)`` (a strided view), a 4-D
``matmul``'s operand as it is and reshaped (two views of the same bytes). A group keeps one
entry (:class:`SwapTensor`) per exact view, the handle the graph holds, but moves bytes per
storage: a :class:`StorageSpan` is the byte range of one storage that covers every view of
it the group captured, from the first byte any of them reads to the last.

- The offload copies the span once, into one host buffer (or one slice of a bucket).
- The load copies it into one fresh device block, and every view is rebuilt as a view into
  that block (``CopyEngine.restore_views``) at its offset relative to the span's start, with its
  shape, strides and dtype: views that overlapped before the offload share one allocation
  again, and the device holds the span once, not once per view.
- The span's start is rounded down so that it keeps its address's alignment to
  :data:`SPAN_ALIGNMENT` bytes (where the storage's base allows): a restored block starts
  at such a boundary, so every view sits at the alignment it had (kernels may pick their
  code path by alignment).
- The integrity checks stay per view: each view's digest is taken on its own elements,
  read out of the span's bytes (:meth:`StorageSpan.views`).

All entries of a span are in the same state at every moment: they move together.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ppswap.backends.base import ViewKey
from ppswap.backends.types import HostArray
from ppswap.swap.errors import SwapError
from ppswap.swap.tensor import CheckMode, SwapState, SwapTensor, content_digest, digest_bytes

__all__ = [
    "SPAN_ALIGNMENT",
    "StorageSpan",
    "dense_nbytes",
    "span_layout",
    "view_array",
    "view_digest",
]

SPAN_ALIGNMENT = 64


def span_layout(storage_ptr: int, keys: Sequence[ViewKey]) -> tuple[int, int, list[int]]:
    """``(start, nbytes, offsets)``: the span of ``keys`` (views of the storage at
    ``storage_ptr``) as a byte range of the storage, and each view's byte offset in it.

    ``start`` keeps the address's alignment to :data:`SPAN_ALIGNMENT` when the storage's
    base allows it, and is always a multiple of every view's element size (so each view
    starts on an element boundary of the span). A view without elements is placed at
    offset 0 and does not widen the span.
    """
    if len(keys) == 1:  # the common case (every span on MindSpore)
        (key,) = keys
        first, end = key.byte_range()
        if end == first:
            return 0, 0, [0]
        start = _span_start(storage_ptr, first, key.itemsize)
        return start, end - start, [key.offset * key.itemsize - start]
    ranges = [key.byte_range() for key in keys]
    used = [(first, end) for first, end in ranges if end > first]
    if not used:
        return 0, 0, [0] * len(keys)
    low, high = min(first for first, _ in used), max(end for _, end in used)
    start = _span_start(storage_ptr, low, math.lcm(*(key.itemsize for key in keys)))
    offsets = [
        key.offset * key.itemsize - start if end > first else 0
        for key, (first, end) in zip(keys, ranges, strict=True)
    ]
    return start, high - start, offsets


def _span_start(storage_ptr: int, low: int, unit: int) -> int:
    """The first byte of a span whose first used byte is ``low``: rounded down to keep
    the address's alignment to :data:`SPAN_ALIGNMENT` where the storage allows it and
    that is a multiple of ``unit`` (the views' element sizes), else ``low`` rounded down
    to a multiple of ``unit``."""
    start = low - (storage_ptr + low) % SPAN_ALIGNMENT
    if start < 0 or start % unit:
        start = low - low % unit
    return start


def dense_nbytes(key: ViewKey) -> int | None:
    """The byte count of view ``key`` if its elements are C-contiguous (the strides of
    dimensions of size 1 do not matter), else None."""
    count = 1
    for n, stride in zip(reversed(key.shape), reversed(key.strides), strict=True):
        if n != 1 and stride != count:
            return None
        count *= n
    return count * key.itemsize


def view_digest(
    span: HostArray, offset: int, key: ViewKey, mode: CheckMode, nbytes: int | None
) -> int:
    """``content_digest(view_array(span, offset, key), mode)``; ``nbytes`` is
    ``dense_nbytes(key)``: where not None, the elements are read in place."""
    if nbytes is None:
        return content_digest(view_array(span, offset, key), mode)
    return digest_bytes(span[offset : offset + nbytes], key.itemsize, mode)


def view_array(span: HostArray, offset: int, key: ViewKey) -> HostArray:
    """The elements of view ``key`` in ``span`` (a contiguous ``uint8`` array holding a
    span's bytes), ``offset`` bytes in: a numpy view, with void elements of the view's
    size (the digests read bytes, not values)."""
    return np.ndarray(
        key.shape,
        dtype=np.dtype((np.void, key.itemsize)),
        buffer=span,
        offset=offset,
        strides=tuple(s * key.itemsize for s in key.strides),
    )


@dataclass(eq=False, slots=True)
class StorageSpan:
    """The used bytes of one storage in a group, and the views (entries) in them.

    ``start`` / ``nbytes``: the byte range of the storage (``storage_ptr``) that moves;
    ``entries``: the views, ``offsets``: each one's byte offset in the span (in the same
    order). ``bulk``: packed into a host bucket (every entry asked for ``group_swap``).
    ``source``: what the copy thread reads the span's device bytes from (from the end of
    the forward to ``finish_offload``); ``host``: the host copy (a ``uint8`` array: a
    pooled buffer of its own, or a slice of ``host_bucket``), from ``finish_offload`` to
    the load. ``dense``: per entry, its byte count where its elements are C-contiguous
    (the digests then read them straight from the span's bytes), else None.
    ``digests``: the entries' reference digests (taken when the forward ends), None where
    the version counter is the check.

    ``offsets``, ``dense`` and ``digests`` are tuples of ints: the garbage collector stops
    tracking them at its first pass, so a span that lives from its forward to its backward
    keeps one tracked container (``entries``) besides itself.
    """

    storage_ptr: int
    start: int
    nbytes: int
    entries: list[SwapTensor]
    offsets: tuple[int, ...]
    bulk: bool
    dense: tuple[int | None, ...]
    source: Any = None
    host: HostArray | None = None
    host_bucket: Any = None
    digests: tuple[int, ...] | None = None

    @classmethod
    def of(cls, storage_ptr: int, entries: list[SwapTensor]) -> StorageSpan:
        """The span of ``entries`` (every captured view of one storage); the span keeps
        that list as its ``entries``, not a copy (the group's list of the storage's views,
        which no longer changes once the forward has ended)."""
        if len(entries) == 1:  # one view (every span on MindSpore): no zips or comprehensions
            (entry,) = entries
            key = entry.key
            dense = dense_nbytes(key)
            if dense:  # C-contiguous, with elements: span_layout's result, computed inline
                first = key.offset * key.itemsize
                start = _span_start(storage_ptr, first, key.itemsize)
                nbytes, offset = first + dense - start, first - start
                span = cls(storage_ptr, start, nbytes, entries, (offset,), entry.bulk, (dense,))
            else:
                start, nbytes, offsets = span_layout(storage_ptr, (key,))
                span = cls(storage_ptr, start, nbytes, entries, (offsets[0],), entry.bulk, (dense,))
            entry.span = span
            return span
        start, nbytes, offsets = span_layout(storage_ptr, [e.key for e in entries])
        span = cls(
            storage_ptr=storage_ptr,
            start=start,
            nbytes=nbytes,
            entries=entries,
            offsets=tuple(offsets),
            bulk=all(e.bulk for e in entries),
            dense=tuple(dense_nbytes(e.key) for e in entries),
        )
        for entry in entries:
            entry.span = span
        return span

    @property
    def members(self) -> list[tuple[SwapTensor, int]]:
        """Each entry with its view's byte offset in the span."""
        return list(zip(self.entries, self.offsets, strict=True))

    @property
    def state(self) -> SwapState:
        """The members' state (they move together)."""
        return self.entries[0].state

    def places(self) -> list[tuple[int, ViewKey]]:
        """``(offset, key)`` per member: what ``CopyEngine.restore_views`` rebuilds."""
        return [
            (offset, entry.key) for entry, offset in zip(self.entries, self.offsets, strict=True)
        ]

    def movable(self) -> bool:
        """Whether the span may leave the device now: no member pinned, all on device."""
        for entry in self.entries:
            if entry.pinned or entry.state is not SwapState.DEVICE:
                return False
        return True

    def transition(self, to_state: SwapState) -> None:
        """Move every member to ``to_state`` (legal moves only; all or, on a refused
        move, the members before it)."""
        for entry in self.entries:
            entry.transition(to_state)

    def views(self, array: HostArray) -> list[HostArray]:
        """Each member's elements in ``array`` (a contiguous ``uint8`` copy of the span)."""
        return [
            view_array(array, offset, entry.key)
            for entry, offset in zip(self.entries, self.offsets, strict=True)
        ]

    def digests_of(self, array: HostArray, mode: CheckMode) -> list[int]:
        """Each member's content digest in ``array`` (a contiguous ``uint8`` copy of the
        span): ``content_digest`` of its elements, read in place where they are dense."""
        entries, offsets, dense = self.entries, self.offsets, self.dense
        if len(entries) == 1:
            nbytes, offset = dense[0], offsets[0]
            if nbytes is not None:
                itemsize = entries[0].key.itemsize
                return [digest_bytes(array[offset : offset + nbytes], itemsize, mode)]
        return [
            view_digest(array, offset, entry.key, mode, nbytes)
            for entry, offset, nbytes in zip(entries, offsets, dense, strict=True)
        ]

    def take_digests(self, array: HostArray, mode: CheckMode) -> None:
        """Record each member's reference digest from ``array`` (the span's device bytes
        as the host sees them, when the forward ended)."""
        self.digests = tuple(self.digests_of(array, mode))

    def verify(self, array: HostArray | None, mode: CheckMode, where: str) -> None:
        """Raise ``SwapError`` if a member's elements in ``array`` (a copy of the span)
        differ from its reference digest; no-op without reference digests or a
        host-visible array."""
        expected = self.digests
        if array is None or expected is None:
            return
        found = self.digests_of(array, mode)
        for entry, before, now in zip(self.entries, expected, found, strict=True):
            if before != now:
                raise SwapError(
                    f"group {entry.group!r} tensor {entry.tag!r} was modified in place "
                    f"{where} (content digest changed); refusing to swap stale data"
                )

    def __repr__(self) -> str:
        return (
            f"StorageSpan(storage_ptr={self.storage_ptr:#x}, start={self.start}, "
            f"nbytes={self.nbytes}, views={len(self.entries)})"
        )
