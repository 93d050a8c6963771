"""``swap_policy="peak"`` (``ppswap.scheduler.peak``) on hand-checked schedules. The property
over every schedule family is in tests/swap_plan/test_swap_properties.py, runs through
``run_schedule`` in tests/cost/test_cost_runtime.py (MindSpore) and tests/torch_backend."""

from __future__ import annotations

import pytest

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import build_orders
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.peak import build_peak_orders
from ppswap.scheduler.simulate import memory_profile
from ppswap.scheduler.steps import Order
from ppswap.scheduler.swap_plan import eligible_chunks


def _peak(order: Order) -> int:
    return max(memory_profile(order), default=0)


def test_a_rank_whose_peak_no_swap_lowers_moves_nothing() -> None:
    """1F1B pp4 m16: the gap rule swaps 14 chunks of rank 1 and its peak stays at 3 chunks;
    the peak policy swaps none there and half of rank 0's."""
    config = ScheduleConfig(schedule="1f1b", pp=4, micro=16, swap=True)
    gap, peak = build_all_orders(config), build_peak_orders(config)
    assert [len(eligible_chunks(order)) for order in gap] == [16, 14, 0, 0]
    assert [len(eligible_chunks(order)) for order in peak] == [8, 0, 0, 0]
    assert [_peak(order) for order in peak] == [_peak(order) for order in gap] == [3, 3, 2, 1]


def test_interleaved_pp2_moves_fewer_chunks_for_the_same_peak() -> None:
    """The benchmark's Interleaved (pp2 vpp2 m8): rank 0 14 -> 8 chunks, rank 1 all 8."""
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=8, swap=True)
    gap, peak = build_all_orders(config), build_orders(config, "peak")
    assert [len(eligible_chunks(order)) for order in gap] == [14, 8]
    assert [len(eligible_chunks(order)) for order in peak] == [8, 8]
    assert [_peak(order) for order in peak] == [_peak(order) for order in gap] == [3, 2]


def test_without_swap_the_policy_is_the_plain_order() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=4)
    assert build_peak_orders(config) == build_all_orders(config)
    assert build_orders(config, "peak") == build_all_orders(config)
    with pytest.raises(TypeError, match="config must be a ScheduleConfig, got dict"):
        build_peak_orders({"pp": 2})  # type: ignore[arg-type]
