"""The copy bodies of a group's offload and load jobs (no framework calls of their own).

These functions run on the copy thread. They only see what a job carries: the copy
sources, the host buffers, the buckets, and move bytes with the engine's primitives. They
take no locks; the group wraps them. The unit they move is a storage span
(``spans.py``): one copy per span, of its bytes as ``uint8``, all of an offload's spans
in one engine call (``d2h_many``), each into a host buffer of its own or a slice of its
bucket; a load's single spans into one device allocation per block of at most
``bucket_bytes`` (``h2d_block``), a bucket in one copy. After the copies they compare
content digests where the group keeps them (``StorageSpan.verify``, per view): the host
copy against the reference taken when the forward ended, the source again after the copy
(a write during the copy), a load against the host copy.

Bucket layout (``group_swap=True``): spans are placed in capture order at 64-byte aligned
offsets; a bucket never exceeds ``bucket_bytes`` unless it holds one span that is larger
by itself (such a span gets a bucket of its own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ppswap.backends.base import CopyEngine
from ppswap.backends.host_memory import HOST_ALIGNMENT, Array
from ppswap.swap.spans import StorageSpan
from ppswap.swap.tensor import CheckMode

__all__ = [
    "CopySlot",
    "HostBucket",
    "LoadBlock",
    "LoadPlan",
    "aligned",
    "load_blocks",
    "pack_buckets",
    "release_load_buffers",
    "release_offload_buffers",
    "run_load",
    "run_offload",
]


@dataclass(eq=False)
class CopySlot:
    """What one span's copy needs: source, destination, place in its bucket."""

    span: StorageSpan
    src: Any = None
    host: Array | None = None
    loaded: Any = None
    block: tuple[str, int] | None = None
    block_nbytes: int = 0
    offset: int = 0


@dataclass(eq=False)
class HostBucket:
    """A contiguous host buffer holding several spans of one group; ``holding`` counts
    the spans still in it."""

    nbytes: int
    members: list[tuple[CopySlot, int]] = field(default_factory=list)
    raw: Array | None = None
    holding: int = 0


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the host alignment (64 bytes)."""
    return -(-nbytes // HOST_ALIGNMENT) * HOST_ALIGNMENT


def pack_buckets(slots: list[CopySlot], bucket_bytes: int) -> list[HostBucket]:
    """Place slots, in order, into buckets of at most ``bucket_bytes`` (see module doc)."""
    buckets: list[HostBucket] = []
    current: HostBucket | None = None
    for slot in slots:
        size = slot.span.nbytes
        if current is not None and aligned(current.nbytes) + size <= bucket_bytes:
            offset = aligned(current.nbytes)
        else:
            current = HostBucket(nbytes=0)
            buckets.append(current)
            offset = 0
        current.members.append((slot, offset))
        current.nbytes = offset + size
    return buckets


def _verify_offloaded(engine: CopyEngine, slot: CopySlot, check: CheckMode) -> None:
    if slot.span.digests is None:  # the version counter is the check (torch)
        return
    slot.span.verify(slot.host, check, "after capture")
    slot.span.verify(engine.host_view(slot.src), check, "while its offload copy ran")


def run_offload(
    engine: CopyEngine, single: list[CopySlot], buckets: list[HostBucket], check: CheckMode
) -> None:
    """Copy every span to host, all in one engine call: one pooled buffer per single
    slot, a slice of one per bucket."""
    into: list[Array | None] = [None] * len(single)
    slots = list(single)
    for bucket in buckets:
        bucket.raw = raw = engine.acquire_host(bucket.nbytes)
        for slot, offset in bucket.members:
            slots.append(slot)
            into.append(raw[offset : offset + slot.span.nbytes])
    if not slots:
        return
    sources = []
    for slot in slots:
        assert slot.src is not None
        sources.append(slot.src)
    for slot, host in zip(slots, engine.d2h_many(sources, into), strict=True):
        slot.host = host  # every buffer has its slot before a check may raise
    for slot in slots:
        _verify_offloaded(engine, slot, check)
        slot.src = None


@dataclass(eq=False)
class LoadBlock:
    """One device block a load job allocates for spans that have a host buffer each: its
    slots (each at its ``offset``) and its size."""

    slots: list[CopySlot]
    nbytes: int


def load_blocks(slots: list[CopySlot], block_bytes: int) -> list[LoadBlock]:
    """Place ``slots`` in device blocks by the host buckets' rule (:func:`pack_buckets`):
    in order, 64-byte aligned, at most ``block_bytes`` a block unless one span is larger."""
    blocks = []
    for layout in pack_buckets(slots, block_bytes):
        for slot, offset in layout.members:
            slot.offset = offset
        blocks.append(LoadBlock([slot for slot, _ in layout.members], layout.nbytes))
    return blocks


def run_load(
    engine: CopyEngine,
    blocks: list[LoadBlock],
    buckets: list[tuple[HostBucket, list[CopySlot]]],
    check: CheckMode,
) -> None:
    """Copy host spans to fresh device memory: the spans of a block into slices of one
    allocation (``h2d_block``), a bucket in one copy whose spans become slices of it."""
    where = "while it was on the host (load)"
    for block in blocks:
        hosts = []
        for slot in block.slots:
            assert slot.host is not None
            hosts.append(slot.host)
        offsets = [slot.offset for slot in block.slots]
        loaded_spans = engine.h2d_block(hosts, offsets, block.nbytes)
        for slot, loaded in zip(block.slots, loaded_spans, strict=True):
            if slot.span.digests is not None:
                slot.span.verify(engine.host_view(loaded), check, where)
            slot.loaded = loaded
    for bucket, bucket_slots in buckets:
        assert bucket.raw is not None
        raw = bucket.raw
        block = engine.h2d(raw)
        for slot in bucket_slots:
            host = raw[slot.offset : slot.offset + slot.span.nbytes]
            loaded = engine.member(block, slot.offset, host)
            if slot.span.digests is not None:
                slot.span.verify(engine.host_view(loaded), check, where)
            slot.loaded = loaded


def release_load_buffers(
    engine: CopyEngine,
    single: list[CopySlot],
    buckets: list[tuple[HostBucket, list[CopySlot]]],
) -> None:
    """Give a load job's host buffers back to the pool (each exactly once)."""
    for slot in single:
        if slot.host is not None:
            engine.release_host(slot.host)
            slot.host = None
    for bucket, _ in buckets:
        if bucket.raw is not None:
            engine.release_host(bucket.raw)
            bucket.raw = None


def release_offload_buffers(
    engine: CopyEngine, slots: list[CopySlot], buckets: list[HostBucket]
) -> None:
    """Give an offload job's host buffers back (used when its group was discarded)."""
    for slot in slots:
        if slot.host is not None and not slot.span.bulk:
            engine.release_host(slot.host)
        slot.host = None
    for bucket in buckets:
        if bucket.raw is not None:
            engine.release_host(bucket.raw)
            bucket.raw = None


@dataclass(eq=False)
class LoadPlan:
    """What one load job moves: single spans (placed in ``blocks``), and buckets with
    their moving spans.

    Each slot gets the accounting block its data will land in: one per single span
    (counting that span's bytes, although the engine places the spans of a
    :class:`LoadBlock` in one allocation: they are loaded, held and released together),
    one per bucket (shared by its spans, sized as the whole bucket).
    """

    single: list[CopySlot]
    blocks: list[LoadBlock]
    buckets: list[tuple[HostBucket, list[CopySlot]]]

    @classmethod
    def build(
        cls,
        host_spans: list[StorageSpan],
        host_buckets: list[HostBucket],
        new_block: Callable[[], tuple[str, int]],
        block_bytes: int,
    ) -> LoadPlan:
        """Plan the load of ``host_spans`` (on the host, not bucketed; device blocks of
        at most ``block_bytes``) and of the spans still in ``host_buckets``."""
        single = [
            CopySlot(span=span, host=span.host, block=new_block(), block_nbytes=span.nbytes)
            for span in host_spans
        ]
        buckets: list[tuple[HostBucket, list[CopySlot]]] = []
        for bucket in host_buckets:
            moving = [
                (member.span, offset)
                for member, offset in bucket.members
                if member.span.host is not None
            ]
            if not moving:
                continue
            block = new_block()
            buckets.append(
                (
                    bucket,
                    [
                        CopySlot(span=span, block=block, block_nbytes=bucket.nbytes, offset=offset)
                        for span, offset in moving
                    ],
                )
            )
        return cls(single=single, blocks=load_blocks(single, block_bytes), buckets=buckets)

    @property
    def slots(self) -> list[CopySlot]:
        return self.single + [slot for _, slots in self.buckets for slot in slots]

    @property
    def nbytes(self) -> int:
        return sum(s.span.nbytes for s in self.single) + sum(b.nbytes for b, _ in self.buckets)

    def run(self, engine: CopyEngine, check: CheckMode) -> None:
        run_load(engine, self.blocks, self.buckets, check)

    def release(self, engine: CopyEngine) -> None:
        release_load_buffers(engine, self.single, self.buckets)
