"""bfloat16 on the host: the numpy dtype numpy itself lacks.

Batches, P2P payloads between processes, losses and FSDP shards travel as numpy arrays, and
numpy has no bfloat16. ``ml_dtypes`` (with ``ppswap[torch]`` and ``ppswap[mindspore]``)
adds one: :data:`BFLOAT16` is that dtype, or None where ``ml_dtypes`` is not installed
(then the torch backend refuses a bfloat16 tensor it must move through numpy, naming the
package, and the wire refuses bfloat16). MindSpore registers a numpy bfloat16 of its own, a
different type under the same name: :func:`is_bfloat16` recognizes either (by name and
size), and the wire format sends either as :data:`BFLOAT16` (``wire_array``), so what
crosses a process boundary arrives as that one (both frameworks read it: torch through
``int16``, MindSpore's ``Tensor.from_numpy`` as it is).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = [
    "BFLOAT16",
    "BFLOAT16_MISSING",
    "BFLOAT16_NAME",
    "dtype_name",
    "is_bfloat16",
    "is_floating",
    "named_dtype",
]

BFLOAT16: np.dtype[Any] | None
try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes comes with ppswap[torch]
    BFLOAT16 = None
else:
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

BFLOAT16_MISSING = (
    "numpy has no bfloat16 and the ml_dtypes package, which adds it, is not installed "
    "(pip install ml_dtypes; ppswap's torch and mindspore extras install it)"
)


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` is a numpy bfloat16 (``ml_dtypes``', or MindSpore's own)."""
    # kind first: numpy computes ``name`` in Python, and this runs for every array the
    # torch backend wraps (each swapped storage's restored view among them)
    return dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16"


def is_floating(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` holds floating-point numbers (numpy's own, or bfloat16)."""
    return dtype.kind == "f" or is_bfloat16(dtype)


BFLOAT16_NAME = b"bfloat16"
_MAX_NAME_BYTES = 32  # the dtype field of the wire header and of a packed array's table


def dtype_name(dtype: np.dtype[Any]) -> bytes | None:
    """The name a dtype travels under (the wire header, ``core.wire``; a packed array's
    table, ``core.packed``): :data:`BFLOAT16_NAME` for ``ml_dtypes``' bfloat16, else
    ``dtype.str`` where it names ``dtype`` exactly in at most 32 bytes, else None (it
    cannot travel: object, structured and other extension dtypes, MindSpore's bfloat16
    until viewed as ``ml_dtypes``')."""
    if BFLOAT16 is not None and type(dtype) is type(BFLOAT16):  # a dtype class per type
        return BFLOAT16_NAME
    if dtype.hasobject or dtype.fields is not None or np.dtype(dtype.str) != dtype:
        return None
    encoded = dtype.str.encode("ascii")
    return encoded if len(encoded) <= _MAX_NAME_BYTES else None


def named_dtype(name: bytes, what: str) -> np.dtype[Any]:
    """The dtype :func:`dtype_name` named ``name``; ``what`` (``"a bfloat16 message"``)
    names what arrived in the error where ``ml_dtypes`` is missing."""
    if name == BFLOAT16_NAME:
        if BFLOAT16 is None:
            raise RuntimeError(f"{what} arrived, but {BFLOAT16_MISSING}")
        return BFLOAT16
    return np.dtype(name.decode("ascii"))
