"""ppswap.metrics: one flat snapshot per rank from a real run (both backends), every field a
documented gauge; the loop-lag monitor sees a loop held up."""

from __future__ import annotations

import dataclasses
import time

import anyio
import pytest
from lm_support import BACKENDS, small_lm

from ppswap import LoopLagMonitor, RankMetrics, rank_metrics
from ppswap.metrics import metric_fields


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.asyncio
async def test_a_snapshot_per_rank_maps_the_run_one_to_one(backend: str) -> None:
    lm = small_lm(backend)
    async with LoopLagMonitor(interval_s=0.002) as lag:
        result = await lm.run()
        snapshot = rank_metrics(result, loop_lag_s=lag.take_max_s())
    assert lag.samples > 0
    assert [m.rank for m in snapshot] == [s.rank for s in result.ranks] == [0, 1]
    for metrics, stats in zip(snapshot, result.ranks, strict=True):
        assert metrics.generation == result.generation
        assert metrics.step_time_s == result.step_time_s > 0
        assert metrics.peak_saved_bytes == stats.peak_saved_bytes > 0
        assert metrics.offloaded_bytes == stats.offloaded_bytes
        assert metrics.loaded_bytes == stats.loaded_bytes == stats.offloaded_bytes
        assert metrics.exposed_copy_wait_s == stats.exposed_copy_wait_s
        assert metrics.copy_busy_s == stats.copy_busy_s
        assert metrics.compute_busy_s == pytest.approx(sum(stats.compute_job_s.values()))
        assert 0 < metrics.compute_busy_s <= result.step_time_s
        assert metrics.event_loop_lag_s == snapshot[0].event_loop_lag_s >= 0
    assert sum(m.offloaded_bytes for m in snapshot) > 0


def test_every_gauge_is_a_number_with_its_help() -> None:
    names = [field.name for field in dataclasses.fields(RankMetrics)]
    gauges = dict(metric_fields())
    assert list(gauges) == names[1:] and names[0] == "rank"
    assert all(len(text) > 10 for text in gauges.values())
    assert all(field.type in ("int", "float") for field in dataclasses.fields(RankMetrics)), (
        "an exporter maps numbers only"
    )


def test_refused_values_name_themselves() -> None:
    with pytest.raises(ValueError, match="interval_s must be a number of seconds > 0, got 0"):
        LoopLagMonitor(interval_s=0)
    with pytest.raises(ValueError, match="loop_lag_s must be a number of seconds >= 0, got -1"):
        rank_metrics(None, loop_lag_s=-1)  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_the_monitor_sees_a_blocked_loop() -> None:
    async with LoopLagMonitor(interval_s=0.002) as lag:
        await anyio.sleep(0.02)
        time.sleep(0.1)  # the loop cannot run anything for 100 ms
        await anyio.sleep(0.02)
        blocked = lag.take_max_s()
        assert lag.take_max_s() < blocked  # a take starts over
    assert blocked >= 0.09  # the 100 ms hold, less the clocks' rounding
    assert lag.max_s >= blocked
