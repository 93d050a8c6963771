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

__all__ = ["BFLOAT16", "BFLOAT16_MISSING", "is_bfloat16", "is_floating"]

BFLOAT16: np.dtype[Any] | None
try:
    import ml_dtypes
except ImportError:  # pragma: no cover - ml_dtypes comes with ppswap[torch]
    BFLOAT16 = None
else:
    BFLOAT16 = np.dtype(ml_dtypes.bfloat16)

BFLOAT16_MISSING = (
    "numpy has no bfloat16 and the ml_dtypes package, which adds it, is not installed "
    "(pip install 'ppswap[torch]' installs it)"
)


def is_bfloat16(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` is a numpy bfloat16 (``ml_dtypes``', or MindSpore's own)."""
    # kind first: numpy computes ``name`` in Python, and this runs for every array the
    # torch backend wraps (each swapped storage's restored view among them)
    return dtype.kind == "V" and dtype.itemsize == 2 and dtype.name == "bfloat16"


def is_floating(dtype: np.dtype[Any]) -> bool:
    """Whether ``dtype`` holds floating-point numbers (numpy's own, or bfloat16)."""
    return dtype.kind == "f" or is_bfloat16(dtype)
