"""The warning of a swap run that moved nothing: ``swap=True``, the plan swaps chunks of
some stages, and their forwards marked nothing that could move.

Swap moves only what the stages mark (``swap_wrapper``, ``swap_tensor_wrapper``); the
schedule decides when. A run with ``swap=True`` on stages that mark nothing runs as
without swap, and would say nothing: ``warn_if_nothing_swapped`` emits one
:class:`~ppswap.swap.errors.SwapWarning` per run that names those stages.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import Order, StepKind, iter_leaves
from ppswap.swap.errors import SwapWarning

__all__ = ["unswapped_stages", "warn_if_nothing_swapped"]


def unswapped_stages(orders: Sequence[Order], offloaded_bytes: Mapping[int, int]) -> list[int]:
    """The stages whose chunks the plan swaps on a rank that offloaded no byte.

    ``orders``: every rank's finalized order (indexed by rank); ``offloaded_bytes``: rank ->
    the bytes swap moved to the host there (``RankStats.offloaded_bytes``), for the ranks
    this process ran. Sorted, each once.
    """
    stages: set[int] = set()
    for rank, moved in offloaded_bytes.items():
        if moved:
            continue
        stages.update(
            step.stage
            for step in iter_leaves(orders[rank])
            if step.kind is StepKind.SWAP_LAUNCH_OFFLOAD
        )
    return sorted(stages)


def warn_if_nothing_swapped(
    config: ScheduleConfig, orders: Sequence[Order], offloaded_bytes: Mapping[int, int]
) -> None:
    """One ``SwapWarning`` naming the stages of ``unswapped_stages`` when a training run
    with swap has any; nothing otherwise (swap off, forward-only, or every rank whose plan
    swaps moved bytes)."""
    if not config.swap or config.forward_only:
        return
    stages = unswapped_stages(orders, offloaded_bytes)
    if not stages:
        return
    warnings.warn(
        f"swap=True moved nothing on stages {', '.join(map(str, stages))}: their forwards "
        "marked no saved activation that can move (wrap the blocks whose activations may "
        "move with ppswap.swap.swap_wrapper, or mark tensors with swap_tensor_wrapper; "
        "storages under swap_min_bytes stay)",
        SwapWarning,
        stacklevel=2,
    )
