"""``simulate_run``'s copy streams: offloads and loads on separate FIFOs, as the runtime's
``CopyStream`` runs them (one thread per direction), so a load never queues behind an
offload; ``split_directions=False`` is one FIFO for both. Pure: no framework.

A wrong single FIFO made slow copies look costlier than they are wherever a load is
launched right after an offload: in every steady-state step of 1F1B + overlap_b_f with
swap (``OBF[B0.0+F4.0] ... LO4.0 WO3.0 LL2.0 ... WL1.0``), and in GPipe's backward phase.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel
from ppswap.scheduler.cost_simulation import simulate_run
from ppswap.scheduler.lowering import build_all_orders


def model(copy_s: float, *, shared: bool = False) -> CostModel:
    """1 s per leaf, 1000-byte chunks, every copy taking ``copy_s`` seconds each way."""
    gbps = 1000 / copy_s / 1e9
    return CostModel(
        chunk_bytes=1000, d2h_gbps=gbps, h2d_gbps=gbps, leaf_s=1.0, shared_compute=shared
    )


def test_loads_do_not_queue_behind_offloads() -> None:
    # GPipe pp1 m4, copies of one slot: F0 [0,1] LO0 [1,2] F1 [1,2] LO1 [2,3] F2 [2,3]
    # LO2 [3,4] LL0 [3,4] F3 [3,4] LO3 [4,5] LL1 [4,5] B0 [4,5] LL2 [5,6] B1 [5,6]
    # LL3 [6,7] B2 [6,7] B3 [7,8]: every wait finds its copy done. On one FIFO LL0 waits
    # for LO2 and the waits expose 2 s (tests/cost/test_cost_planner.py).
    config = ScheduleConfig(schedule="gpipe", pp=1, micro=4, swap=True)
    orders = build_all_orders(config)
    two = simulate_run(config, orders, model(1.0))
    assert two.exposed_s == (0.0,)
    assert two.step_s == 8.0
    assert two.copy_busy_s == (8.0,)
    one = simulate_run(config, orders, replace(model(1.0), split_directions=False))
    assert one.exposed_s == pytest.approx((2.0,))


@pytest.mark.parametrize(
    ("copy_s", "shared", "one_fifo", "two_fifos"),
    [
        (1.0, False, 1.0, 0.0),
        (2.0, False, 12.0, 3.0),
        (3.0, False, 34.0, 7.0),
        (2.0, True, 4.0, 2.0),
    ],
)
def test_slow_copies_queued_inside_overlapped_pairs(
    copy_s: float, shared: bool, one_fifo: float, two_fifos: float
) -> None:
    """1F1B + overlap_b_f pp4 m8: rank 0 swaps; from the first OVERLAP_B_F on, each pair
    is followed by an offload launch and a load launch. With its loads on their own
    stream the rank waits only where the loads themselves fall behind."""
    config = ScheduleConfig(schedule="1f1b", pp=4, micro=8, overlap_b_f=True, swap=True)
    orders = build_all_orders(config)
    shorts = " ".join(step.short() for step in orders[0])
    assert "OBF[B0.0+F4.0] SF4.0 LO4.0 WO3.0 LL2.0 RB1.0 WL1.0" in shorts
    cost = model(copy_s, shared=shared)
    two = simulate_run(config, orders, cost)
    one = simulate_run(config, orders, replace(cost, split_directions=False))
    assert two.exposed_s == pytest.approx((two_fifos, 0.0, 0.0, 0.0))
    assert one.exposed_s == pytest.approx((one_fifo, 0.0, 0.0, 0.0))
    assert two.step_s <= one.step_s
    assert two.copy_busy_s == one.copy_busy_s


def test_split_directions_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match="split_directions must be a bool, got 1"):
        replace(model(1.0), split_directions=1)  # type: ignore[arg-type]
