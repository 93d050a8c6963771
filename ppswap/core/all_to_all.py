"""``AllToAll``: the all-to-all a MoE block routes tokens over, as its compute sees it.

``all_to_all(key, arrays)`` sends ``arrays[j]`` (host arrays, any number of rows) to EP
member ``j`` and returns what every member sent here, in member order. Implemented by
``ppswap.moe.ExpertExchange`` (through the rank's P2P actor) and ``LocalExchange`` (the
one-member group, every expert local). The backends' MoE blocks depend on this
protocol only. ``ExpertBlock`` is what such a block offers expert parallelism
(``ppswap.moe.expert_parallel`` splits its experts, ``fully_shard`` leaves them unsharded).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeGuard, runtime_checkable

import numpy as np

from ppswap.core.messages import HostArray

__all__ = ["AllToAll", "ExpertBlock", "LocalExchange", "expert_parameter_ids", "is_expert_block"]


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


@runtime_checkable
class ExpertBlock(Protocol):
    """What a MoE block offers expert parallelism: its expert count, the experts it keeps
    (``first``, ``count``), the stacked expert parameters (framework tensors), the
    all-to-all it routes tokens over (None: every expert is local), whether its
    forward and backward may run on a thread of their own, interleaved with other
    forwards and backwards of the process (``runs_in_fibers``, ``ppswap.core.fiber``),
    and its optional load-balancing loss (``aux_loss_coef``, ``bind_aux``)."""

    @property
    def num_experts(self) -> int: ...

    @property
    def runs_in_fibers(self) -> bool: ...

    @property
    def kept_experts(self) -> tuple[int, int]: ...

    def keep_experts(self, first: int, count: int) -> None: ...

    def expert_parameters(self) -> tuple[Any, ...]: ...

    def bind_exchange(self, exchange: AllToAll | None, key: str = "moe") -> None: ...

    @property
    def aux_loss_coef(self) -> float:
        """The load-balancing loss's coefficient (0: the block has none)."""
        ...

    def bind_aux(self, grad_scale: float, record: Callable[[Any], None] | None = None) -> None:
        """The load-balancing term's gradient scale in the block's backward (0: none),
        and ``record``, given each forward's term (a detached framework scalar)."""
        ...


def is_expert_block(value: object) -> TypeGuard[ExpertBlock]:
    return isinstance(value, ExpertBlock)


def expert_parameter_ids(modules: Any) -> frozenset[int]:
    """``id`` of every expert parameter of the MoE blocks among ``modules``."""
    return frozenset(
        id(param) for sub in modules if is_expert_block(sub) for param in sub.expert_parameters()
    )
