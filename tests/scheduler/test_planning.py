"""planned_orders: a run configuration is built and validated once, and an equal
configuration gets the very same orders."""

from __future__ import annotations

import pytest

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import build_orders
from ppswap.scheduler.planning import PLANS_KEPT, planned_orders


def _config(micro: int, *, swap: bool = True) -> ScheduleConfig:
    return ScheduleConfig(schedule="1f1b", pp=4, vpp=1, micro=micro, swap=swap)


def test_an_equal_configuration_gets_the_same_orders() -> None:
    planned_orders.cache_clear()
    first = planned_orders(_config(8))
    assert planned_orders(_config(8)) is first  # equal, not the same object: still kept
    assert first == build_orders(_config(8))
    assert planned_orders(_config(8, swap=False)) is not first
    assert planned_orders.cache_info().hits == 1


def test_only_the_last_plans_are_kept() -> None:
    planned_orders.cache_clear()
    first = planned_orders(_config(8))
    for micro in range(9, 9 + PLANS_KEPT):
        planned_orders(_config(micro))
    assert planned_orders(_config(8)) is not first
    assert planned_orders(_config(8)) == first


def test_a_refused_policy_raises_every_time() -> None:
    for _ in range(2):
        with pytest.raises(ValueError, match="swap_policy"):
            planned_orders(_config(8), "fastest")  # type: ignore[arg-type]
