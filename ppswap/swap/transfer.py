"""The copy bodies of a group's offload and load jobs (no framework calls of their own).

An :class:`Offload` or :class:`Load` is what one job moves, fixed on the compute thread
when the job is prepared: the storage spans (``spans.py``) in lists, with what the copy
thread reads (the copy sources, the host buffers) captured in lists of their own, and
the list the copy thread fills (the host copies, the loaded arrays) in the same order.
The copy thread never writes a span: it only reads each span's size and, for the content
checks, its views and digests, which no longer change once the forward has ended. The
group takes the results under its lock once the job is done.

An offload copies every span to the host in one engine call (``d2h_many``), each into a
pooled buffer of its own or a slice of its bucket. A load copies the spans that have a
buffer of their own into one device allocation per block of at most ``bucket_bytes``
(``h2d_block``), and each bucket in one copy (``h2d``) whose spans become slices of it
(``member``). After the copies, where the group keeps content digests, they are compared
(``StorageSpan.verify``, per view): the host copy against the reference taken when the
forward ended, the source again after the copy (a write during the copy), a load against
the host copy.

Placement (:func:`pack_buckets`, for ``group_swap=True`` host buckets and for a load's
device blocks alike): spans in capture order at 64-byte aligned offsets; a bucket never
exceeds ``bucket_bytes`` unless it holds one span that is larger by itself (such a span
gets a bucket of its own).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ppswap.backends.base import CopyEngine
from ppswap.backends.host_memory import HOST_ALIGNMENT, Array
from ppswap.swap.spans import StorageSpan
from ppswap.swap.tensor import CheckMode

__all__ = [
    "ByteSized",
    "HostBucket",
    "Load",
    "Offload",
    "aligned",
    "pack_buckets",
]


class ByteSized(Protocol):
    """What placement reads of a span: its byte count."""

    @property
    def nbytes(self) -> int: ...


@dataclass(eq=False)
class HostBucket:
    """A contiguous host buffer holding several spans of one group: ``members`` are the
    spans with their byte offsets in it, ``holding`` counts the spans still in it."""

    nbytes: int
    members: list[tuple[Any, int]] = field(default_factory=list)
    raw: Array | None = None
    holding: int = 0


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the host alignment (64 bytes)."""
    return -(-nbytes // HOST_ALIGNMENT) * HOST_ALIGNMENT


def pack_buckets(spans: Sequence[ByteSized], bucket_bytes: int) -> list[HostBucket]:
    """Place ``spans``, in order, into buckets of at most ``bucket_bytes`` (module doc)."""
    buckets: list[HostBucket] = []
    current: HostBucket | None = None
    for span in spans:
        size = span.nbytes
        if current is not None and aligned(current.nbytes) + size <= bucket_bytes:
            offset = aligned(current.nbytes)
        else:
            current = HostBucket(nbytes=0)
            buckets.append(current)
            offset = 0
        current.members.append((span, offset))
        current.nbytes = offset + size
    return buckets


@dataclass(eq=False)
class Offload:
    """What one offload job copies: ``spans`` (first ``single`` with a host buffer of
    their own, then each bucket's members in order) and their copy ``sources``;
    ``hosts``, filled by :meth:`run`, each span's host copy in the same order."""

    spans: list[StorageSpan]
    sources: list[Any]
    single: int
    buckets: list[HostBucket]
    hosts: list[Array] = field(default_factory=list)

    @classmethod
    def build(cls, movable: list[StorageSpan], bucket_bytes: int) -> Offload:
        """The offload of ``movable``: spans with ``bulk`` packed into host buckets of at
        most ``bucket_bytes``, the others into buffers of their own."""
        spans = [span for span in movable if not span.bulk]
        single = len(spans)
        buckets = pack_buckets([span for span in movable if span.bulk], bucket_bytes)
        for bucket in buckets:
            spans.extend(span for span, _ in bucket.members)
        return cls(spans, [span.source for span in spans], single, buckets)

    @property
    def nbytes(self) -> int:
        return sum(span.nbytes for span in self.spans)

    def run(self, engine: CopyEngine, check: CheckMode) -> None:
        """Copy every span to the host in one engine call (copy thread), then compare
        the digests where the spans keep them."""
        if not self.spans:
            return
        into: list[Array | None] = [None] * self.single
        for bucket in self.buckets:
            bucket.raw = raw = engine.acquire_host(bucket.nbytes)
            for span, offset in bucket.members:
                into.append(raw[offset : offset + span.nbytes])
        self.hosts = engine.d2h_many(self.sources, into)  # every buffer kept before a check
        for span, host, source in zip(self.spans, self.hosts, self.sources, strict=True):
            if span.digests is not None:  # None: the version counter is the check (torch)
                span.verify(host, check, "after capture")
                span.verify(engine.host_view(source), check, "while its offload copy ran")
        self.sources = []

    def release(self, engine: CopyEngine) -> None:
        """Give the job's host buffers back (its group was discarded before it finished)."""
        for host in self.hosts[: self.single]:
            engine.release_host(host)
        self.hosts = []
        for bucket in self.buckets:
            if bucket.raw is not None:
                engine.release_host(bucket.raw)
                bucket.raw = None


@dataclass(eq=False)
class Load:
    """What one load job copies: ``single`` spans (each with its host buffer in ``hosts``
    and its byte offset in its device block in ``offsets``; ``blocks`` gives each block's
    first and end index into them and its size), then ``buckets``, each with its members
    still on the host (and their offsets in it). ``spans`` lists every span the job
    moves, the single ones first; ``loaded``, filled by :meth:`run`, has each span's
    loaded array in that order."""

    single: list[StorageSpan]
    hosts: list[Array]
    offsets: list[int]
    blocks: list[tuple[int, int, int]]
    buckets: list[tuple[HostBucket, list[tuple[StorageSpan, int]]]]
    spans: list[StorageSpan]
    loaded: list[Any] = field(default_factory=list)

    @classmethod
    def build(
        cls, host_spans: list[StorageSpan], host_buckets: list[HostBucket], block_bytes: int
    ) -> Load:
        """The load of ``host_spans`` (on the host, in buffers of their own; device blocks
        of at most ``block_bytes``) and of the spans still in ``host_buckets``."""
        hosts: list[Array] = []
        for span in host_spans:
            assert span.host is not None
            hosts.append(span.host)
        offsets: list[int] = []
        blocks = []
        for block in pack_buckets(host_spans, block_bytes):
            first = len(offsets)
            offsets.extend(offset for _, offset in block.members)
            blocks.append((first, len(offsets), block.nbytes))
        buckets = []
        spans = list(host_spans)
        for bucket in host_buckets:
            moving = [(span, offset) for span, offset in bucket.members if span.host is not None]
            if moving:
                buckets.append((bucket, moving))
                spans.extend(span for span, _ in moving)
        return cls(host_spans, hosts, offsets, blocks, buckets, spans)

    @property
    def nbytes(self) -> int:
        return sum(span.nbytes for span in self.single) + sum(b.nbytes for b, _ in self.buckets)

    def run(self, engine: CopyEngine, check: CheckMode) -> None:
        """Copy the spans to fresh device memory (copy thread), then compare each with
        its host copy's digests where the spans keep them."""
        loaded: list[Any] = []
        hosts, offsets = self.hosts, self.offsets
        for first, end, nbytes in self.blocks:
            loaded.extend(engine.h2d_block(hosts[first:end], offsets[first:end], nbytes))
        for bucket, moving in self.buckets:
            raw = bucket.raw
            assert raw is not None
            block = engine.h2d(raw)
            for span, offset in moving:
                loaded.append(engine.member(block, offset, raw[offset : offset + span.nbytes]))
        where = "while it was on the host (load)"
        for span, array in zip(self.spans, loaded, strict=True):
            if span.digests is not None:
                span.verify(engine.host_view(array), check, where)
        self.loaded = loaded

    def release(self, engine: CopyEngine) -> None:
        """Give the job's host buffers back to the pool (each once; again: nothing)."""
        for host in self.hosts:
            engine.release_host(host)
        self.hosts = []
        for bucket, _ in self.buckets:
            if bucket.raw is not None:
                engine.release_host(bucket.raw)
                bucket.raw = None
