"""Several arrays as one: a stage's tuple of activations (or of their gradients) on the wire.

The multi-process transports move one array per message. A stage that passes several
tensors to the next (``(hidden, mask)``) hands them over as a tuple; on its way between
processes that tuple travels as one ``uint8`` array of the dtype :data:`PACKED`, which the
wire header names ``ppswap.tuple``:

- a table: the element count, then per element its dtype (``core.dtypes.dtype_name``; any
  numpy bfloat16 as ``ml_dtypes``', the same bytes, as the wire sends it; empty for
  a missing element: a gradient nobody computed, as for an integer mask), ndim, shape and
  the offset of its bytes;
- the elements' bytes, each at a 64-byte boundary.

:func:`pack` copies each element in once; :func:`unpack` returns views of the packed
array (no copy), each aligned for its dtype. Pure numpy and the standard library.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ppswap.core.dtypes import BFLOAT16, dtype_name, is_bfloat16, named_dtype

__all__ = ["MAX_ELEMENTS", "PACKED", "PACKED_NAME", "is_packed", "pack", "unpack"]

Array = npt.NDArray[Any]

PACKED: np.dtype[Any] = np.dtype([("ppswap_tuple", np.uint8)])
"""The dtype of a packed array (one byte per item): the mark the receiver unpacks by."""
PACKED_NAME = b"ppswap.tuple"
"""How the wire header names :data:`PACKED`."""
MAX_ELEMENTS = 64
_MAX_NDIM = 32
_ALIGN = 64
_COUNT = struct.Struct("<8sq")  # magic, element count
_MAGIC = b"ppswtup1"
_ELEMENT = struct.Struct("<32sqq")  # dtype name, ndim, offset; then ndim int64 dims


def is_packed(value: object) -> bool:
    """Whether ``value`` is a packed array (:func:`pack`'s result, or one received)."""
    return isinstance(value, np.ndarray) and value.dtype == PACKED


def _aligned(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def pack(elements: Sequence[Array | None]) -> Array:
    """One :data:`PACKED` array holding ``elements`` (None: a missing element)."""
    if not 0 < len(elements) <= MAX_ELEMENTS:
        raise ValueError(f"can pack 1 to {MAX_ELEMENTS} elements, got {len(elements)}")
    names: list[bytes] = []
    arrays: list[Array | None] = []
    for position, element in enumerate(elements):
        if element is None:
            names.append(b"")
            arrays.append(None)
            continue
        if not isinstance(element, np.ndarray):
            raise TypeError(
                f"element {position} must be a numpy.ndarray or None, got {type(element).__name__}"
            )
        if element.ndim > _MAX_NDIM:
            raise ValueError(f"element {position} has ndim {element.ndim}; at most {_MAX_NDIM}")
        if BFLOAT16 is not None and is_bfloat16(element.dtype):
            element = element.view(BFLOAT16)  # MindSpore's own: the same bytes
        name = dtype_name(element.dtype)
        if name is None:
            raise TypeError(
                f"element {position} has dtype {element.dtype!r}; allowed: numeric, bool and "
                "bfloat16"
            )
        names.append(name)
        arrays.append(element)
    # the layout first: the table, then each element at the next 64-byte boundary
    table_bytes = _COUNT.size + sum(
        _ELEMENT.size + (0 if e is None else 8 * e.ndim) for e in arrays
    )
    offsets: list[int] = []
    end = _aligned(table_bytes)
    for element in arrays:
        offsets.append(0 if element is None else end)
        end = end if element is None else _aligned(end + element.nbytes)
    packed = np.empty(end, dtype=np.uint8)
    table = bytearray(_COUNT.pack(_MAGIC, len(arrays)))
    filled = table_bytes
    for element, name, offset in zip(arrays, names, offsets, strict=True):
        if element is None:
            table += _ELEMENT.pack(b"", 0, 0)
            continue
        table += _ELEMENT.pack(name, element.ndim, offset)
        table += struct.pack(f"<{element.ndim}q", *element.shape)
        packed[filled:offset] = 0  # the padding before it: no stale bytes on the wire
        target = packed[offset : offset + element.nbytes].view(element.dtype)
        np.copyto(target.reshape(element.shape), element, casting="no")
        filled = offset + element.nbytes
    packed[filled:] = 0
    packed[:table_bytes] = np.frombuffer(bytes(table), dtype=np.uint8)
    return packed.view(PACKED)


def unpack(packed: Array) -> tuple[Array | None, ...]:
    """The elements of a packed array: views of it (no copy), None where one is missing."""
    raw = packed.view(np.uint8).reshape(-1)
    buffer = bytes(raw[: _COUNT.size])
    magic, count = _COUNT.unpack(buffer) if len(buffer) == _COUNT.size else (b"", 0)
    if magic != _MAGIC or not 0 < count <= MAX_ELEMENTS:
        raise ValueError("not a packed array (bad magic or element count)")
    header = bytes(raw[: min(raw.size, _COUNT.size + count * (_ELEMENT.size + 8 * _MAX_NDIM))])
    cursor = _COUNT.size
    elements: list[Array | None] = []
    for _ in range(count):
        name, ndim, offset = _ELEMENT.unpack_from(header, cursor)
        cursor += _ELEMENT.size
        name = name.rstrip(b"\0")
        if not name:
            elements.append(None)
            continue
        if not 0 <= ndim <= _MAX_NDIM:
            raise ValueError(f"corrupt packed array: an element of ndim {ndim}")
        shape = struct.unpack_from(f"<{ndim}q", header, cursor)
        cursor += 8 * ndim
        dtype = named_dtype(name, "a packed bfloat16 element")
        nbytes = dtype.itemsize * math.prod(shape)
        if offset < cursor or offset + nbytes > raw.size:
            raise ValueError(f"corrupt packed array: element at {offset} of {nbytes} bytes")
        element = raw[offset : offset + nbytes].view(dtype).reshape(shape)
        # a received array may start anywhere in its buffer: a view off its dtype's
        # alignment is copied (frameworks may refuse or slow down on one)
        elements.append(element if element.flags.aligned else element.copy())
    return tuple(elements)
