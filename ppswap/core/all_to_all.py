"""``AllToAll``: the all-to-all a MoE block routes tokens over, as its compute sees it.

``all_to_all(key, arrays)`` sends ``arrays[j]`` (host arrays, any number of rows) to EP
member ``j`` and returns what every member sent here, in member order. Implemented by
``ppswap.moe.ExpertExchange`` (through the rank's P2P actor) and ``LocalExchange`` (the
one-member group, every expert local). The backends' MoE blocks depend on this
protocol only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from ppswap.core.messages import HostArray

__all__ = ["AllToAll", "LocalExchange"]


class AllToAll(Protocol):
    """The all-to-all a MoE block routes tokens over (module docstring)."""

    @property
    def size(self) -> int:
        """The number of EP members."""
        ...

    @property
    def index(self) -> int:
        """This rank's place among them."""
        ...

    def all_to_all(self, key: str, arrays: Sequence[HostArray]) -> list[HostArray]: ...


class LocalExchange:
    """The all-to-all of a one-member group: what is sent is what is received."""

    size = 1
    index = 0

    def all_to_all(self, key: str, arrays: Sequence[HostArray]) -> list[HostArray]:
        if len(arrays) != 1:
            raise ValueError(f"all_to_all {key!r}: one array per member (1), got {len(arrays)}")
        return [np.asarray(arrays[0])]
