"""Deprecated: the CPU copy engine moved to ``ppswap.backends.cpu_engine`` (same names;
``EmulatedDevice`` and ``CopyEngine`` are also exported by ``ppswap.swap`` and
``EmulatedDevice`` by ``ppswap``).

Importing this module warns (``DeprecationWarning``) and re-exports them; it will be
removed in a later release.
"""

import warnings

from ppswap.backends.base import CopyEngine
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.backends.host_memory import (
    HOST_ALIGNMENT,
    Array,
    CopyCounters,
    PoolStats,
    size_class,
)

__all__ = [
    "HOST_ALIGNMENT",
    "Array",
    "CopyCounters",
    "CopyEngine",
    "EmulatedDevice",
    "PoolStats",
    "size_class",
]

warnings.warn(
    "ppswap.swap.device moved to ppswap.backends.cpu_engine; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
