"""Every rank's finalized, validated order for a run configuration, built once.

A training loop calls ``run_schedule`` every step with the same configuration; building
and validating the orders is a pure function of ``(config, swap_policy, cost_model)``
(all frozen, hashable values) whose result is immutable (tuples of frozen ``MetaStep``),
so the last few plans are kept and shared. At pp4 m32 validation alone is several
milliseconds, which would otherwise be paid again by every step.
"""

from __future__ import annotations

import functools

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import SwapPolicy, build_orders
from ppswap.scheduler.cost_model import CostModel
from ppswap.scheduler.recompute_plan import inject_recompute_steps
from ppswap.scheduler.steps import Order
from ppswap.scheduler.validate import validate_all

__all__ = ["PLANS_KEPT", "planned_orders"]

PLANS_KEPT = 4
"""Plans kept: a loop that alternates training and evaluation uses two."""


@functools.lru_cache(maxsize=PLANS_KEPT)
def planned_orders(
    config: ScheduleConfig,
    swap_policy: SwapPolicy = "gap",
    cost_model: CostModel | None = None,
    recompute: frozenset[tuple[int, int]] = frozenset(),
) -> tuple[Order, ...]:
    """``build_orders``, the RECOMPUTE steps of the chunks ``recompute``
    (``recompute_plan.inject_recompute_steps``), then ``validate_all``; the same tuple for
    an equal configuration. An invalid configuration raises every time (exceptions are
    not kept)."""
    orders = build_orders(config, swap_policy, cost_model)
    if recompute:
        orders = tuple(
            inject_recompute_steps(order, config, rank, recompute)
            for rank, order in enumerate(orders)
        )
    validate_all(config, orders)
    return orders
