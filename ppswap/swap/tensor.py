"""Storage and SwapTensor: the state machine of a captured saved tensor's bytes, and the
handle (a Storage) that the autograd graph keeps for it.

States and the only legal moves (anything else raises :class:`SwapStateError`)::

    DEVICE --prepare_offload--> D2H --finish_offload--> HOST
      ^                                                   |
      +------finish_load------- H2D <----prepare_load-----+

- ``DEVICE``: the bytes are in device memory; :attr:`Storage.device` holds the tensor.
- ``D2H``: an offload job was prepared; the device tensor is still alive and still valid
  (the copy only reads it), the host copy is being written.
- ``HOST``: the host copy is complete and verified; the device reference is dropped, so
  the device memory is freed as soon as nothing else holds it.
- ``H2D``: a load job was prepared; the host copy is being copied to fresh device memory.

A :class:`SwapTensor` is the *handle* the autograd graph keeps (the pack hook returns it);
the graph never holds the device tensor itself, which is what lets ``finish_offload``
really release memory. Backward's unpack calls :meth:`SwapTensor.materialize`, which
returns the live tensor or, through its owner (the group), waits for or performs the load
(the safety net). An entry refers to its group weakly (the group owns its entries, not the
reverse), so a released chunk's records are freed by reference counting, not left for
the garbage collector. A materialized tensor is a view rebuilt into the loaded bytes of its
storage's span (``ppswap.swap.spans``): it has the captured shape, strides, offset and
dtype, shares that memory with the other restored views of its storage, and is
bit-identical.

In-place modification (docs/swap.md has the measured trade-off): at capture the storage's
address and size and the framework's version counter are recorded (:data:`Fingerprint`)
and compared again before the copy and before the device reference is dropped. Where the
counter works (torch) that is the whole check. Where it does not (MindSpore 2.10 never
bumps ``_version``), content digests stand in, by :class:`CheckMode`: ``"sampled"`` (the
default) digests 64 evenly spaced elements of each tensor, O(1) per tensor on the compute
thread; ``"full"`` digests every byte. The reference is taken when the forward ends, the
copy thread compares the host copy against it and against the source after copying, the
compute thread compares the source again just before it drops the device tensor, and every
load is compared with the host copy's digest.
"""

from __future__ import annotations

import enum
import functools
import weakref
import zlib
from typing import TYPE_CHECKING, Any, Literal, Protocol, get_args

import numpy as np

from ppswap.backends.base import Backend, StorageRef, ViewKey
from ppswap.backends.types import HostArray, Tensor
from ppswap.swap.errors import SwapError, SwapStateError

if TYPE_CHECKING:
    from ppswap.swap.spans import StorageSpan

__all__ = [
    "CHECK_MODES",
    "DIGEST_SAMPLES",
    "LEGAL_TRANSITIONS",
    "CheckMode",
    "Fingerprint",
    "Storage",
    "StorageInfo",
    "SwapState",
    "SwapTensor",
    "ViewKey",
    "content_digest",
    "digest_bytes",
    "fingerprint_changes",
    "sample_rows",
]

DIGEST_SAMPLES = 64

CheckMode = Literal["sampled", "full"]
CHECK_MODES: tuple[str, ...] = get_args(CheckMode)

StorageInfo = StorageRef
"""The storage a tensor lives in (the name the swap layer has always used)."""


class SwapState(enum.Enum):
    """Where the bytes of a captured tensor are (see the module docstring)."""

    DEVICE = "DEVICE"
    D2H = "D2H"
    HOST = "HOST"
    H2D = "H2D"

    # Singletons compared by identity: hashed by identity too (in C), not by Enum's
    # Python-level hash of the name (every transition looks its move up).
    __hash__ = object.__hash__


LEGAL_TRANSITIONS: dict[SwapState, SwapState] = {
    SwapState.DEVICE: SwapState.D2H,
    SwapState.D2H: SwapState.HOST,
    SwapState.HOST: SwapState.H2D,
    SwapState.H2D: SwapState.DEVICE,
}


Fingerprint = tuple[int, int, int | None]
"""What is checked before D2H and before the device tensor is dropped: the storage's
address and size, and the framework's version counter (None where it has none). A plain
tuple of ints: the garbage collector stops tracking it at its first pass (a fingerprint
lives from its chunk's forward to its offload)."""

_FINGERPRINT_FIELDS = ("storage_ptr", "storage_nbytes", "version")


def fingerprint_changes(before: Fingerprint, after: Fingerprint) -> list[str]:
    """Human-readable list of what changed from ``before`` to ``after``."""
    return [
        f"{name} {old!r} -> {new!r}"
        for name, old, new in zip(_FINGERPRINT_FIELDS, before, after, strict=True)
        if old != new
    ]


def content_digest(array: HostArray, mode: CheckMode = "sampled") -> int:
    """CRC32 of the array's bytes: every byte (``"full"``) or :data:`DIGEST_SAMPLES`
    evenly spaced elements (in C order) plus the byte count (``"sampled"``)."""
    if array.flags.c_contiguous:
        return digest_bytes(array.reshape(-1).view(np.uint8), array.itemsize, mode)
    if mode == "full" or array.size <= DIGEST_SAMPLES:
        return zlib.crc32(np.ascontiguousarray(array).reshape(-1).view(np.uint8).data)
    picked = array[np.unravel_index(sample_rows(array.size), array.shape)]
    return zlib.crc32(picked.view(np.uint8).data, array.nbytes)


def digest_bytes(data: HostArray, itemsize: int, mode: CheckMode) -> int:
    """:func:`content_digest` of C-contiguous ``uint8`` bytes ``data`` that hold elements
    of ``itemsize`` bytes (no view or copy made)."""
    count = data.size // itemsize
    if mode == "full" or count <= DIGEST_SAMPLES:
        return zlib.crc32(data.data)
    return zlib.crc32(data[_sample_bytes(count, itemsize)].data, data.size)


@functools.lru_cache(maxsize=1024)
def _sample_bytes(count: int, itemsize: int) -> HostArray:
    """The byte indices of the elements :func:`sample_rows` picks, in order."""
    picks = sample_rows(count)[:, None] * itemsize + np.arange(itemsize, dtype=np.intp)
    found: HostArray = picks.reshape(-1)
    found.flags.writeable = False
    return found


@functools.lru_cache(maxsize=1024)
def sample_rows(count: int) -> HostArray:
    """The indices of the :data:`DIGEST_SAMPLES` evenly spaced elements of ``count``
    elements (``count`` > DIGEST_SAMPLES) the sampled digest reads; made once per count."""
    step = (count - 1) / (DIGEST_SAMPLES - 1)
    rows = np.array([round(i * step) for i in range(DIGEST_SAMPLES)], dtype=np.intp)
    rows.flags.writeable = False
    return rows


class Storage:
    """One captured view across the tiers: its state and its device tensor.

    Its bytes move with the other captured views of the same storage, as one
    :class:`~ppswap.swap.spans.StorageSpan` (``span``, set when the forward ends; it holds
    the copy source, the host copy and the views' reference digests). Fields are owned by
    the compute thread, which changes them under the group's lock (copy jobs carry their
    own buffers); another thread may read :attr:`state`, always a legal state (one
    attribute, written once per move).
    """

    __slots__ = (
        "_state",
        "device",
        "device_block",
        "dtype",
        "fingerprint",
        "group",
        "job",
        "nbytes",
        "released",
        "shape",
        "span",
        "tag",
    )

    def __init__(
        self,
        group: str,
        tag: str,
        nbytes: int,
        shape: tuple[int, ...],
        dtype: Any,
        device: Tensor | None = None,
        fingerprint: Fingerprint | None = None,
        device_block: tuple[str, int] | None = None,
    ):
        self.group = group
        self.tag = tag
        self.nbytes = nbytes
        self.shape = shape
        self.dtype = dtype
        self._state = SwapState.DEVICE
        self.device = device
        self.device_block = device_block
        self.span: StorageSpan | None = None
        self.job: Any = None
        self.fingerprint = fingerprint
        self.released = False

    @property
    def state(self) -> SwapState:
        return self._state

    @property
    def host_bucket(self) -> Any:
        """The host bucket holding this view's span while it is on the host, if any."""
        return None if self.span is None else self.span.host_bucket

    def transition(self, to_state: SwapState) -> SwapState:
        """Move to ``to_state``; return the previous state. Illegal moves raise."""
        current = self._state
        if self.released:
            raise SwapStateError(
                group=self.group,
                tag=self.tag,
                from_state="released",
                to_state=to_state,
                detail="the group was released",
            )
        if LEGAL_TRANSITIONS[current] is not to_state:
            raise SwapStateError(
                group=self.group, tag=self.tag, from_state=current, to_state=to_state
            )
        self._state = to_state
        return current


class EntryOwner(Protocol):
    """What a SwapTensor needs from its group to answer backward's unpack."""

    def materialize(self, entry: SwapTensor) -> Tensor: ...


class SwapTensor(Storage):
    """Handle of one captured saved tensor, held by the autograd graph (see module doc):
    the :class:`Storage` state of its bytes and what the group knows of the view.

    ``key`` is the exact view identity, ``bulk`` whether it is copied through a group
    bucket (``group_swap=True``), ``pinned`` whether it must never leave the device,
    ``selected`` whether anyone asked for it to be swapped (unselected ones are pinned
    when the forward ends). ``owner`` is a weak reference to the group (module docstring):
    once the group is gone, :meth:`materialize` raises as for a released group. One object
    per captured view: it lives from the view's forward to its backward, and every object
    that lives that long adds to the garbage collector's passes.
    """

    __slots__ = (
        "__weakref__",
        "_owner",
        "bulk",
        "chunk",
        "key",
        "pinned",
        "selected",
    )

    def __init__(
        self,
        owner: weakref.ref[EntryOwner],
        group: str,
        tag: str,
        key: ViewKey,
        bulk: bool,
        chunk: tuple[int, int],
        device: Tensor,
        fingerprint: Fingerprint,
        device_block: tuple[str, int],
        selected: bool = True,
        pinned: bool = False,
    ) -> None:
        """A new DEVICE entry holding ``device`` (the captured view, ``key``) with its
        capture ``fingerprint``; its storage is held on device as ``device_block``.
        Arguments by position: one entry is made per saved view a forward captures, so
        the fields are set here, not through ``Storage.__init__`` (a call less each)."""
        shape = key.shape
        count = 1
        for n in shape:
            count *= n
        self.group = group
        self.tag = tag
        self.nbytes = count * key.itemsize
        self.shape = shape
        self.dtype = key.dtype
        self._state = SwapState.DEVICE
        self.device = device
        self.device_block = device_block
        self.span = None
        self.job = None
        self.fingerprint = fingerprint
        self.released = False
        self._owner = owner
        self.key = key
        self.bulk = bulk
        self.chunk = chunk
        self.pinned = pinned
        self.selected = selected

    def materialize(self) -> Tensor:
        """The tensor for backward: live, waited for, or loaded now (never partial)."""
        device = self.device
        # A tensor on device (never moved, or loaded and finished) needs no lock: its
        # state, device tensor and release change only on the compute thread, which runs
        # this unpack (or waits in the backward that runs it).
        if self._state is SwapState.DEVICE and device is not None and not self.released:
            return device
        owner = self._owner()
        if owner is None:
            raise SwapStateError(
                group=self.group,
                tag=self.tag,
                from_state="released",
                to_state=SwapState.DEVICE,
                detail="backward unpacked a tensor of a group that no longer exists",
            )
        return owner.materialize(self)

    def check_unchanged(self, backend: Backend, when: str) -> None:
        """Raise :class:`SwapError` if the storage or version changed since capture
        (compute thread; O(1))."""
        device = self.device
        expected = self.fingerprint
        if device is None or expected is None:
            raise SwapError(f"group {self.group!r} tensor {self.tag!r} lost its device tensor")
        ptr, nbytes = backend.storage_of(device)
        version = backend.version_of(device)
        if (ptr, nbytes, version) != expected:
            changes = fingerprint_changes(expected, (ptr, nbytes, version))
            raise SwapError(
                f"group {self.group!r} tensor {self.tag!r}: its storage changed after "
                f"capture ({'; '.join(changes)}) {when}; refusing to offload"
            )

    def __repr__(self) -> str:
        pin = ", pinned" if self.pinned else ""
        return (
            f"SwapTensor(group={self.group!r}, tag={self.tag!r}, state={self.state.name}, "
            f"shape={self.shape}, nbytes={self.nbytes}{pin})"
        )
