"""SwapTensor and Storage: one captured saved tensor and the state machine of its bytes.

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
(the safety net). A materialized tensor is rebuilt with ``Tensor.from_numpy`` from the
loaded bytes; it is contiguous, has the captured shape and dtype, and is bit-identical.

Identity and the checks before D2H: at capture the storage's base address, its size
(``untyped_storage().nbytes()``), the view's shape/dtype and MindSpore's ``_version``
counter are recorded (:class:`Fingerprint`); at the end of the forward a content digest is
taken. Before D2H all of them are compared again. MindSpore 2.10 never bumps ``_version``
(measured: not for ``add_``, ``mul_``, ``__setitem__`` or numpy writes), so in-place
modification is detected by the digest: a CRC32 of the whole tensor up to
:data:`FULL_DIGEST_MAX_BYTES`, of :data:`DIGEST_SAMPLES` evenly spaced elements above.
"""

from __future__ import annotations

import enum
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from mindspore import Tensor

from ppswap.swap.device import Array
from ppswap.swap.errors import SwapError, SwapStateError

__all__ = [
    "DIGEST_SAMPLES",
    "FULL_DIGEST_MAX_BYTES",
    "LEGAL_TRANSITIONS",
    "Fingerprint",
    "Storage",
    "StorageInfo",
    "SwapState",
    "SwapTensor",
    "ViewKey",
    "content_digest",
]

FULL_DIGEST_MAX_BYTES = 1 << 20
DIGEST_SAMPLES = 4096


class SwapState(enum.Enum):
    """Where the bytes of a captured tensor are (see the module docstring)."""

    DEVICE = "DEVICE"
    D2H = "D2H"
    HOST = "HOST"
    H2D = "H2D"


LEGAL_TRANSITIONS: dict[SwapState, SwapState] = {
    SwapState.DEVICE: SwapState.D2H,
    SwapState.D2H: SwapState.HOST,
    SwapState.HOST: SwapState.H2D,
    SwapState.H2D: SwapState.DEVICE,
}


@dataclass(frozen=True)
class StorageInfo:
    """The device storage a tensor lives in: base address and size in bytes."""

    ptr: int
    nbytes: int

    @classmethod
    def of(cls, tensor: Tensor) -> StorageInfo:
        storage = tensor.untyped_storage()
        return cls(ptr=int(storage.data_ptr()), nbytes=int(storage.nbytes()))


@dataclass(frozen=True)
class ViewKey:
    """Exact identity of a view: same storage, offset, shape, strides and dtype.

    Only tensors with equal keys share one :class:`SwapTensor`; a view and its base (or
    two different views of one storage) are separate entries, each copied on its own.
    """

    storage_ptr: int
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str

    @classmethod
    def of(cls, tensor: Tensor, storage: StorageInfo | None = None) -> ViewKey:
        info = storage if storage is not None else StorageInfo.of(tensor)
        return cls(
            storage_ptr=info.ptr,
            offset=int(tensor.storage_offset()),
            shape=tuple(int(d) for d in tensor.shape),
            strides=tuple(int(s) for s in tensor.stride()),
            dtype=str(tensor.dtype),
        )


@dataclass(frozen=True)
class Fingerprint:
    """What is checked before D2H: storage address and size, view shape, dtype, version."""

    storage_ptr: int
    storage_nbytes: int
    shape: tuple[int, ...]
    dtype: str
    version: int

    @classmethod
    def of(cls, tensor: Tensor, storage: StorageInfo | None = None) -> Fingerprint:
        info = storage if storage is not None else StorageInfo.of(tensor)
        return cls(
            storage_ptr=info.ptr,
            storage_nbytes=info.nbytes,
            shape=tuple(int(d) for d in tensor.shape),
            dtype=str(tensor.dtype),
            version=int(getattr(tensor, "_version", 0)),
        )

    def differences(self, other: Fingerprint) -> list[str]:
        """Human-readable list of what changed from ``self`` to ``other``."""
        changed = []
        for name in ("storage_ptr", "storage_nbytes", "shape", "dtype", "version"):
            before, after = getattr(self, name), getattr(other, name)
            if before != after:
                changed.append(f"{name} {before!r} -> {after!r}")
        return changed


def content_digest(array: Array) -> int:
    """CRC32 of the array's bytes (whole up to 1 MiB, evenly spaced elements above)."""
    flat = np.ascontiguousarray(array).reshape(-1)
    if flat.nbytes <= FULL_DIGEST_MAX_BYTES:
        return zlib.crc32(flat.view(np.uint8).data)
    rows = flat.view(np.uint8).reshape(flat.size, flat.itemsize)
    picks = np.linspace(0, flat.size - 1, num=DIGEST_SAMPLES).astype(np.int64)
    return zlib.crc32(np.ascontiguousarray(rows[picks]).data)


class Storage:
    """The bytes of one captured view across the tiers, and their state.

    Fields are owned by the compute thread; the copy thread never touches a Storage (copy
    jobs carry their own buffers). :meth:`transition` is atomic under the storage's lock
    so a concurrent reader of :attr:`state` always sees a legal state.
    """

    def __init__(self, *, group: str, tag: str, nbytes: int, shape: tuple[int, ...], dtype: Any):
        self.group = group
        self.tag = tag
        self.nbytes = nbytes
        self.shape = shape
        self.dtype = dtype
        self._lock = threading.Lock()
        self._state = SwapState.DEVICE
        self.device: Tensor | None = None
        self.device_block: tuple[str, int] | None = None
        self.host: Array | None = None
        self.host_bucket: Any = None
        self.job: Any = None
        self.fingerprint: Fingerprint | None = None
        self.digest: int | None = None
        self.released = False

    @property
    def state(self) -> SwapState:
        with self._lock:
            return self._state

    def transition(self, to_state: SwapState) -> SwapState:
        """Move to ``to_state``; return the previous state. Illegal moves raise."""
        with self._lock:
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


class SwapTensor:
    """Handle of one captured saved tensor, held by the autograd graph (see module doc).

    ``key`` is the exact view identity, ``bulk`` whether it is copied through a group
    bucket (``group_swap=True``), ``pinned`` whether it must never leave the device,
    ``selected`` whether anyone asked for it to be swapped (unselected ones are pinned
    when the forward ends).
    """

    __slots__ = (
        "__weakref__",
        "_owner",
        "bulk",
        "chunk",
        "key",
        "pinned",
        "selected",
        "storage",
        "tag",
    )

    def __init__(
        self,
        *,
        owner: EntryOwner,
        tag: str,
        key: ViewKey,
        storage: Storage,
        bulk: bool,
        chunk: tuple[int, int],
    ) -> None:
        self._owner = owner
        self.tag = tag
        self.key = key
        self.storage = storage
        self.bulk = bulk
        self.chunk = chunk
        self.pinned = False
        self.selected = True

    @classmethod
    def capture(
        cls,
        tensor: Tensor,
        *,
        owner: EntryOwner,
        group: str,
        tag: str,
        key: ViewKey,
        bulk: bool,
        chunk: tuple[int, int],
        storage_info: StorageInfo | None = None,
    ) -> SwapTensor:
        """A new DEVICE entry holding ``tensor`` with its capture fingerprint."""
        storage = Storage(
            group=group, tag=tag, nbytes=int(tensor.nbytes), shape=key.shape, dtype=tensor.dtype
        )
        storage.device = tensor
        storage.fingerprint = Fingerprint.of(tensor, storage_info)
        return cls(owner=owner, tag=tag, key=key, storage=storage, bulk=bulk, chunk=chunk)

    @property
    def state(self) -> SwapState:
        return self.storage.state

    @property
    def group(self) -> str:
        return self.storage.group

    @property
    def nbytes(self) -> int:
        """Bytes of the view's data (what is copied), not of its whole storage."""
        return self.storage.nbytes

    def transition(self, to_state: SwapState) -> SwapState:
        """Move this tensor's storage to ``to_state`` (legal moves only)."""
        return self.storage.transition(to_state)

    def materialize(self) -> Tensor:
        """The tensor for backward: live, waited for, or loaded now (never partial)."""
        return self._owner.materialize(self)

    def checked_view(self) -> Array:
        """The checks before D2H, then a numpy view of the device data (compute thread).

        Raises :class:`SwapError` if the storage changed since capture (address, size,
        shape, dtype, ``_version``) or its content digest differs from the one taken at
        the end of the forward (an in-place modification).
        """
        storage = self.storage
        device = storage.device
        if device is None or storage.fingerprint is None:
            raise SwapError(f"group {self.group!r} tensor {self.tag!r} lost its device tensor")
        changes = storage.fingerprint.differences(Fingerprint.of(device))
        if changes:
            raise SwapError(
                f"group {self.group!r} tensor {self.tag!r}: its storage changed after "
                f"capture ({'; '.join(changes)}); refusing to offload"
            )
        view: Array = device.asnumpy()
        if storage.digest is not None and content_digest(view) != storage.digest:
            raise SwapError(
                f"group {self.group!r} tensor {self.tag!r} was modified in place after "
                "capture (content digest changed); refusing to offload stale data"
            )
        return view

    def verify(self, array: Array, where: str) -> None:
        """Raise :class:`SwapError` if ``array`` does not hold the captured data."""
        expected = self.storage.digest
        if expected is not None and content_digest(array) != expected:
            raise SwapError(
                f"group {self.group!r} tensor {self.tag!r}: data changed during {where} "
                "(digest mismatch); the copy is not trustworthy"
            )

    def __repr__(self) -> str:
        pin = ", pinned" if self.pinned else ""
        return (
            f"SwapTensor(group={self.group!r}, tag={self.tag!r}, state={self.state.name}, "
            f"shape={self.storage.shape}, nbytes={self.nbytes}{pin})"
        )
