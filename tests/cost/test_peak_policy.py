"""``swap_policy="peak"`` (``ppswap.scheduler.peak``) on hand-checked schedules, and through
``run_schedule``: the same numbers as the gap rule with fewer bytes moved. The property
over every schedule family is in tests/swap_plan/test_swap_properties.py."""

from __future__ import annotations

import numpy as np
import pytest

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import build_orders
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.peak import build_peak_orders
from ppswap.scheduler.simulate import memory_profile
from ppswap.scheduler.steps import Order
from ppswap.scheduler.swap_plan import eligible_chunks
from ppswap.swap import swap_wrapper


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


# -- through the runtime (MindSpore, the default backend) ---------------------------------------
DIM, MICRO = 8, 4


@pytest.mark.asyncio
async def test_the_run_matches_the_gap_rule_with_fewer_copies() -> None:
    """GPipe pp2 m4: the gap rule moves all 4 chunks of each rank, the peak policy 2; the
    losses and gradients are bit-identical and the measured peak of saved bytes is the
    same on every rank."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((MICRO * 2, DIM)).astype(np.float32)
    y = rng.standard_normal((MICRO * 2, DIM)).astype(np.float32)
    modules = build_mlp_stages(2, dim=DIM, wrap=swap_wrapper)
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(modules)]
    common = {"micro_batch_num": MICRO, "inputs": x, "targets": y, "loss_fn": mse_loss}
    runs, grads = {}, {}
    for policy in ("gap", "peak"):
        runs[policy] = await run_schedule(stages, "gpipe", swap=True, swap_policy=policy, **common)
        grads[policy] = [[g.asnumpy() for g in s.grads] for s in stages]
    gap, peak = runs["gap"], runs["peak"]
    assert [r.copies for r in gap.ranks] == [2 * MICRO, 2 * MICRO]
    assert [r.copies for r in peak.ranks] == [4, 4]
    assert [r.peak_saved_bytes for r in peak.ranks] == [r.peak_saved_bytes for r in gap.ranks]
    for peak_rank, gap_rank in zip(peak.ranks, gap.ranks, strict=True):
        assert 0 < peak_rank.offloaded_bytes < gap_rank.offloaded_bytes
    assert peak.losses == gap.losses
    for gap_stage, peak_stage in zip(grads["gap"], grads["peak"], strict=True):
        for g0, g1 in zip(gap_stage, peak_stage, strict=True):
            np.testing.assert_array_equal(g0, g1)
