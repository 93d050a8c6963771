"""Swap planner (placeholder pass until the swap-planner issue lands: returns the order)."""

from __future__ import annotations

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import Order


def inject_swap_steps(order: Order, config: ScheduleConfig, rank: int) -> Order:
    """Last lowering pass. Identity for now."""
    del config, rank
    return order
