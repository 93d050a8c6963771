"""The wire format of the multi-process transports (``MPITransport``, the torch.distributed
one): message headers, payload encoding, receive pool.

Pure numpy and the standard library (no MPI or framework import), so it is testable and
readable on its own, and both transports share it. A message is a header (magic, epoch,
identity, byte count, dtype, shape) followed, for payloads up to the transport's inline
limit (``INLINE_MAX_BYTES`` for ``MPITransport``), by the payload itself; larger payloads
travel as a second message (see ``ppswap.transports.mpi``). The dtype is ``dtype.str``, or
``bfloat16`` for ``ml_dtypes``' bfloat16, which ``dtype.str`` does not name
(``ppswap.core.dtypes``), or ``ppswap.tuple`` for several arrays packed into one
(``ppswap.core.packed``: a stage's tuple of activations).
"""

from __future__ import annotations

import functools
import hashlib
import struct
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from sys import getrefcount
from typing import Any

import numpy as np
import numpy.typing as npt

from ppswap.core.dtypes import BFLOAT16, dtype_name, is_bfloat16, named_dtype
from ppswap.core.messages import MessageKey
from ppswap.core.packed import PACKED, PACKED_NAME, pack
from ppswap.core.transport import RecvDone, SendDone, TransportStats

__all__ = [
    "HEADER_MAX_BYTES",
    "INLINE_MAX_BYTES",
    "PAGE_BYTES",
    "POOL_MIN_BYTES",
    "RecvBufferPool",
    "WireCounters",
    "decode_header",
    "digest",
    "encode_message",
    "exchange_per_member",
    "p2p_identity",
    "wire_array",
]

Array = npt.NDArray[Any]

MAGIC = 0x7070_7377_6170_0002  # "ppswap", wire format 2
MAX_NDIM = 32
# magic, epoch, identity, nbytes, ndim, page offset of the sender's body, dtype.str
HEADER_STRUCT = struct.Struct("<Qqqqqq32s")  # then ndim int64 dims
HEADER_MAX_BYTES = HEADER_STRUCT.size + 8 * MAX_NDIM
INLINE_MAX_BYTES = 16 * 1024  # MPITransport inlines payloads up to this size in the header
POOL_MIN_BYTES = 128 << 10  # glibc serves allocations from this size up with fresh mmaps
PAGE_BYTES = 4096
SHAPE_STRUCTS = tuple(struct.Struct(f"<{ndim}q") for ndim in range(MAX_NDIM + 1))
# the whole header of an ndim-dimensional payload, so that encoding is one pack call
HEADER_STRUCTS = tuple(
    struct.Struct(HEADER_STRUCT.format + f"{ndim}q") for ndim in range(MAX_NDIM + 1)
)


class RecvBufferPool:
    """Receive buffers of at least 128 KiB, reused once no array refers to them any more.

    glibc serves allocations from 128 KiB up with fresh ``mmap``s, so a new ``np.empty``
    of that size is paid for in page faults on first touch (for 64 MiB about as long as
    the transfer itself; at 1 MiB it added 15-30 us to a 110 us message); PP runs receive
    the same sizes again and again. The pool owns blocks of up to ``capacity_bytes`` in
    all and hands out views of them; every array derived from a view refers to its block
    (numpy keeps the owning array as ``base``), so a block whose only reference is the
    pool's own is free. Checking that with ``sys.getrefcount`` costs a fraction of a
    microsecond, where a finalizer per buffer cost about 8 us a message. When every block
    of a size is in use and the pool is full, ``take`` falls back to a plain allocation.

    Each block has a page to spare, so that the view can start at the page offset the
    sender's buffer has (``take``'s ``page_offset``): a single-copy transfer into a
    destination 8 or 16 bytes further into its page than the source ran 4 to 8 times
    slower here (``benchmarks/bench_cma_alignment.py``), and equal offsets are never slow.

    ``take`` is called from one thread (the event loop's); arrays may be dropped on any
    thread, which only ever turns a block from in use to free.
    """

    # references to a free block while ``take`` looks at it: the tuple in the pool's
    # list, the loop variable and ``getrefcount``'s own argument
    _FREE_REFCOUNT = 3

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity_bytes = capacity_bytes
        # per size: (block, address of its first byte), in the order they were made
        self._blocks: dict[int, list[tuple[Array, int]]] = {}
        self._held_bytes = 0

    def take(self, nbytes: int, page_offset: int = 0) -> Array:
        """A writable uint8 array of ``nbytes`` (contents undefined).

        From ``POOL_MIN_BYTES`` up, its first byte lies ``page_offset`` bytes into a page
        (``0 <= page_offset < PAGE_BYTES``); smaller arrays are plain allocations.
        """
        if nbytes < POOL_MIN_BYTES or self._capacity_bytes == 0:
            return np.empty(nbytes, dtype=np.uint8)
        blocks = self._blocks.get(nbytes)
        if blocks is None:
            blocks = self._blocks[nbytes] = []
        for block, address in blocks:
            if getrefcount(block) == self._FREE_REFCOUNT:
                start = (page_offset - address) % PAGE_BYTES
                return block[start : start + nbytes]
        block = np.empty(nbytes + PAGE_BYTES, dtype=np.uint8)
        address = block.ctypes.data
        if self._held_bytes + block.nbytes <= self._capacity_bytes:
            blocks.append((block, address))
            self._held_bytes += block.nbytes
        start = (page_offset - address) % PAGE_BYTES
        return block[start : start + nbytes]

    @property
    def held_bytes(self) -> int:
        """Bytes of the blocks the pool owns, in use or free."""
        return self._held_bytes

    def clear(self) -> None:
        """Forget every block (those still in use live on with their arrays)."""
        self._blocks.clear()
        self._held_bytes = 0


@dataclass(slots=True)
class WireCounters:
    """A multi-process transport's P2P counts (its ``TransportStats``) and the number of
    each collective call it made (collective messages are addressed by it)."""

    sent: int = 0
    received: int = 0
    bytes_sent: int = 0
    collective_calls: dict[tuple[str, tuple[int, ...], str], int] = field(default_factory=dict)

    def count_sent(self, nbytes: int) -> None:
        self.sent += 1
        self.bytes_sent += nbytes

    def sent_then(self, nbytes: int, on_done: SendDone, error: BaseException | None) -> None:
        """A started send's callback: counted if it succeeded, then ``on_done``."""
        if error is None:
            self.count_sent(nbytes)
        on_done(error)

    def received_then(
        self, on_done: RecvDone, payload: Array | None, error: BaseException | None
    ) -> None:
        """A started receive's callback: counted if it succeeded, then ``on_done``."""
        if error is None:
            self.received += 1
        on_done(payload, error)

    def next_call(self, op: str, group: tuple[int, ...], key: str) -> tuple[tuple[int, ...], int]:
        """``(sorted members, call number)`` of this rank's next ``op`` on ``(group, key)``
        (the n-th calls of every member meet); a key that is no str is a TypeError."""
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, got {key!r}")
        members = tuple(sorted(group))
        call = self.collective_calls.get((op, members, key), 0)
        self.collective_calls[(op, members, key)] = call + 1
        return members, call

    def stats(self, undelivered: int) -> TransportStats:
        return TransportStats(self.sent, self.received, self.bytes_sent, undelivered)


def digest(*parts: object) -> int:
    """A stable signed 64-bit hash of ``parts`` (the same on every rank and process)."""
    raw = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little", signed=True)


def p2p_identity(key: MessageKey) -> int:
    """``key`` packed into one int (exact, no hash): stage, micro, direction."""
    return (key.stage << 32) | (key.micro << 1) | (key.direction == "B")


@functools.lru_cache(maxsize=256)
def wire_dtype(dtype: np.dtype[Any]) -> bytes | None:
    """The header's name of ``dtype`` (``core.dtypes.dtype_name``; ``ppswap.tuple`` for a
    packed array), else None (not sendable)."""
    return PACKED_NAME if dtype == PACKED else dtype_name(dtype)


def wire_array(payload: object, name: str) -> Array:
    """``payload`` as a C-contiguous array whose dtype survives the header, or raise. Any
    other numpy bfloat16 (MindSpore's) goes as ``ml_dtypes``' (the same bytes); a tuple of
    arrays (and None) as one packed array (``ppswap.core.packed``)."""
    if isinstance(payload, tuple):
        try:
            return pack(payload)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{name} is a tuple: {exc}") from exc
    if not isinstance(payload, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(payload).__name__}")
    if BFLOAT16 is not None and is_bfloat16(payload.dtype):
        payload = payload.view(BFLOAT16)
    if wire_dtype(payload.dtype) is None:
        raise TypeError(
            f"{name} has dtype {payload.dtype!r}; allowed: dtypes named by dtype.str "
            "(numeric, bool, complex, datetime, fixed-width strings) and bfloat16 (with "
            "ml_dtypes installed), not object/structured or other extension dtypes"
        )
    if payload.ndim > MAX_NDIM:
        raise ValueError(f"{name} has ndim {payload.ndim}; at most {MAX_NDIM} allowed")
    # np.ascontiguousarray would turn a 0-d array into a 1-d one
    return payload if payload.flags.c_contiguous else payload.copy(order="C")


async def exchange_per_member(
    arrays: Sequence[object],
    index: int,
    exchange: Callable[[dict[int, Array]], Awaitable[dict[int, Array]]],
) -> tuple[Array, list[Array]]:
    """``reduce_scatter_sum``'s and ``all_to_all``'s sending, for the member at ``index``
    of the group: ``arrays[j]`` (as a wire array) goes to member ``j`` through
    ``exchange`` (outgoing by member index -> received by member index), its own stays
    here. Returns its own array and what every member gave it, in group order."""
    bodies = [wire_array(a, f"arrays[{j}]") for j, a in enumerate(arrays)]
    received = await exchange({j: body for j, body in enumerate(bodies) if j != index})
    return bodies[index], [bodies[j] if j == index else received[j] for j in range(len(bodies))]


def encode_message(
    epoch: int,
    identity: int,
    body: Array,
    page_offset: int = 0,
    inline_max_bytes: int = INLINE_MAX_BYTES,
) -> bytearray:
    """The header, followed by the payload itself when it has at most ``inline_max_bytes``
    (the transport's limit: its receivers post buffers of ``HEADER_MAX_BYTES`` plus that
    much). One writable buffer, the payload copied into it once.

    ``body`` comes from ``wire_array`` (so its dtype is known to be sendable);
    ``page_offset`` is how far into its page a body sent as a second message starts, for
    the receiver to place its buffer alike (see ``RecvBufferPool``).
    """
    ndim = body.ndim
    nbytes = body.nbytes
    struct_of = HEADER_STRUCTS[ndim]
    inline = 0 < nbytes <= inline_max_bytes
    message = bytearray(struct_of.size + (nbytes if inline else 0))
    struct_of.pack_into(
        message,
        0,
        MAGIC,
        epoch,
        identity,
        nbytes,
        ndim,
        page_offset,
        wire_dtype(body.dtype),
        *body.shape,
    )
    if inline:
        payload = np.frombuffer(message, dtype=np.uint8, offset=struct_of.size)
        np.copyto(payload.view(body.dtype).reshape(body.shape), body, casting="no")
    return message


@functools.lru_cache(maxsize=256)
def parse_dtype(dtype_str: bytes) -> np.dtype[Any]:
    name = dtype_str.rstrip(b"\0")
    return PACKED if name == PACKED_NAME else named_dtype(name, "a bfloat16 message")


def describe(what_parts: tuple[object, ...]) -> str:
    return " ".join(map(str, what_parts))


def decode_header(
    header: bytearray, epoch: int, identity: int, what_parts: tuple[object, ...]
) -> tuple[int, np.dtype[Any], tuple[int, ...], int, int]:
    """``(nbytes, dtype, shape, header size, page offset)`` of the header in ``header``.

    ``what_parts`` name the message in errors. This runs on every message's critical
    path, right after a large copy has evicted the caches: each call, lookup and object
    counts, so it avoids a NamedTuple (a Python-level ``__new__``) and ``math.prod``
    (a bytearray also exports its buffer faster than an ndarray). Measured with the
    caches flushed, it went from 10 us to 3-4 us.
    """
    magic, got_epoch, got_identity, nbytes, ndim, page_offset, dtype_str = (
        HEADER_STRUCT.unpack_from(header)
    )
    if magic != MAGIC or not 0 <= ndim <= MAX_NDIM or not 0 <= page_offset < PAGE_BYTES:
        what = describe(what_parts)
        raise RuntimeError(f"{what}: not a ppswap message header (magic {magic:#x})")
    if got_epoch != epoch or got_identity != identity:
        what = describe(what_parts)
        raise RuntimeError(
            f"{what}: the header belongs to another message (epoch {got_epoch}, identity "
            f"{got_identity:#x}; expected epoch {epoch}, identity {identity:#x}): a stale "
            "message from an earlier run, ranks configured with different layouts, group "
            "members that disagree on the group, or a collective tag collision"
        )
    dtype = parse_dtype(dtype_str)
    shape = SHAPE_STRUCTS[ndim].unpack_from(header, HEADER_STRUCT.size)
    count = dtype.itemsize
    for extent in shape:
        count *= extent
    if nbytes != count:
        what = describe(what_parts)
        raise RuntimeError(f"{what}: corrupt header ({nbytes} bytes for {shape} of {dtype})")
    return nbytes, dtype, shape, HEADER_STRUCT.size + 8 * ndim, page_offset
