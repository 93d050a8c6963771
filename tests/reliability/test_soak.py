"""Soak: many consecutive runs (successful, failed, cancelled, forward-only) leak nothing.

``PPSWAP_SOAK_RUNS`` (default 20) sets how many runs are measured after a warm-up cycle;
CI runs the default. Each run is one of a cycle of six kinds, on the same stages and the
same copy engine (as a ``Schedule`` object would keep them). After every run: no ppswap
thread and no other thread than before, no swap group that is not released, no session
holding a chunk, no host buffer lent, and no growth in the number of (released) swap
objects MindSpore may still reference. Over all runs: every host buffer ever allocated is
back in the pool, and no more were allocated than the ranks can hold at once by the plan
(buffers are reused; how many the ranks hold at the *same* time depends on how their
copies overlap, so the bound comes from the plan, not from the warm-up's count), and the
process RSS stays flat (its least-squares slope and
its total growth are bounded; an abandoned forward's activations here are ~1 MB per
chunk, so a leak per failed or cancelled run shows up far above the bounds).

``test_discard_all_is_needed`` shows, on MindSpore itself, why the teardown calls
``ppswap.autograd.discard_all``: forwards recorded and never backwarded keep memory until
it runs.
"""

from __future__ import annotations

import gc
import os
import threading
from collections.abc import Callable
from dataclasses import replace

import anyio
import numpy as np
import pytest
from mindspore import Tensor
from reliability_support import (
    GPIPE,
    Case,
    live_swap_objects,
    make_stages,
    ppswap_threads,
    rss_bytes,
    swap_object_counts,
)

from ppswap import PipelineError, StepKind, run_schedule
from ppswap.core.faults import FaultPlan, call_at, fail_compute
from ppswap.autograd import discard_all, record_forward
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.swap_plan import chunks_on_host_peak
from ppswap.swap import EmulatedDevice

SOAK_RUNS = int(os.environ.get("PPSWAP_SOAK_RUNS", "20"))
SOAK_DIM = 256
SOAK_BATCH = 512
MB = 2**20
# MindSpore itself keeps ~15 KB per forward+backward (measured with a plain
# mindspore.value_and_grad loop as well): ~0.1-0.2 MB per run of 8 chunks here. A leak of
# the runtime (an abandoned chunk's activations) is ~1 MB per chunk.
MAX_SLOPE_BYTES_PER_RUN = 0.5 * MB
MAX_GROWTH_BYTES = 4 * MB + MAX_SLOPE_BYTES_PER_RUN * SOAK_RUNS


def _soak_data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.standard_normal((SOAK_BATCH, SOAK_DIM)).astype(np.float32)
    return x, np.tanh(x)


RunKind = tuple[str, Case, Callable[[anyio.CancelScope], FaultPlan | None], bool]

# name, case, faults (given the run's cancel scope), forward_only
CYCLE: list[RunKind] = [
    ("ok", GPIPE, lambda scope: None, False),
    ("fail", GPIPE, lambda scope: FaultPlan((fail_compute(StepKind.BWD, rank=1, micro=2),)), False),
    (
        "cancel",
        GPIPE,
        lambda scope: FaultPlan((call_at(scope.cancel, StepKind.BWD, rank=0, micro=1),)),
        False,
    ),
    ("forward-only", replace(GPIPE, swap=False), lambda scope: None, True),
    (
        "fail-noswap",
        replace(GPIPE, swap=False),
        lambda scope: FaultPlan((fail_compute(StepKind.FWD, rank=0, micro=3),)),
        False,
    ),
    ("ok-noswap", replace(GPIPE, swap=False), lambda scope: None, False),
]


async def _one_run(stages: list, device: EmulatedDevice, kind: RunKind) -> str:
    _, case, faults, forward_only = kind
    x, y = _soak_data()
    with anyio.CancelScope() as scope:
        try:
            await run_schedule(
                stages,
                case.schedule,
                micro_batch_num=case.micro,
                inputs=x,
                targets=y,
                loss_fn=mse_loss,
                swap=case.swap,
                pp=case.pp,
                forward_only=forward_only,
                faults=faults(scope),
                device=device,
                step_timeout=60.0,
            )
        except PipelineError:
            return "failed"
    return "cancelled" if scope.cancelled_caught else "ok"


def _slope(values: list[float]) -> float:
    index = np.arange(len(values), dtype=np.float64)
    return float(np.polyfit(index, np.asarray(values, dtype=np.float64), 1)[0])


@pytest.mark.soak
@pytest.mark.timeout(1200)
@pytest.mark.asyncio
async def test_consecutive_runs_leak_nothing() -> None:
    stages = make_stages(2, dim=SOAK_DIM)
    device = EmulatedDevice()
    threads_before = threading.active_count()
    baseline = live_swap_objects()
    outcomes: list[str] = []
    retained: list[tuple[int, int]] = []
    orders = build_all_orders(
        ScheduleConfig(schedule=GPIPE.schedule, pp=GPIPE.pp, micro=GPIPE.micro, swap=True)
    )
    offloads = sum(step.kind is StepKind.SWAP_LAUNCH_OFFLOAD for o in orders for step in o)
    pool_bound = 0
    for kind in CYCLE:  # warm-up: every kind once (MindSpore caches, the host pool)
        outcomes.append(await _one_run(stages, device, kind))
        retained.append(swap_object_counts())
        if not pool_bound:  # after the first run, a full one with swap
            taken = device.pool_stats().hits + device.pool_stats().misses
            # Every chunk is one equal MLP stage on equal micro-batches: same buffers each.
            assert taken > 0 and taken % offloads == 0, (taken, offloads)
            pool_bound = sum(chunks_on_host_peak(o) for o in orders) * (taken // offloads)
            assert pool_bound < taken  # tighter than "a new buffer for every copy"
    assert outcomes == ["ok", "failed", "cancelled", "ok", "failed", "ok"]
    gc.collect()
    rss: list[float] = [float(rss_bytes())]
    for index in range(SOAK_RUNS):
        kind = CYCLE[index % len(CYCLE)]
        await _one_run(stages, device, kind)
        gc.collect()
        assert ppswap_threads() == [], kind[0]
        assert threading.active_count() == threads_before, kind[0]
        assert live_swap_objects() == baseline, kind[0]
        pool = device.pool_stats()
        assert pool.lent == 0 and pool.bytes_lent == 0, kind[0]
        rss.append(float(rss_bytes()))
        groups, sessions = swap_object_counts()
        # Released objects MindSpore may still reference: bounded, never one per run.
        assert groups <= max(g for g, _ in retained) + 1, (kind[0], groups)
        assert sessions <= max(s for _, s in retained) + 1, (kind[0], sessions)
    pool = device.pool_stats()
    # None lost, none freed, and reused: never more than the ranks can hold at once.
    assert pool.buffers == pool.misses <= pool_bound, (pool, pool_bound)
    assert pool.hits > 0
    growth = rss[-1] - rss[0]
    slope = _slope(rss)
    assert slope < MAX_SLOPE_BYTES_PER_RUN, f"RSS grows {slope / MB:.2f} MB per run: {rss}"
    assert growth < MAX_GROWTH_BYTES, f"RSS grew {growth / MB:.1f} MB over {SOAK_RUNS} runs"


def _abandon_records(count: int, release: bool) -> int:
    """Record ``count`` forwards and never run their backward; RSS growth in bytes."""
    (module,) = build_mlp_stages(1, dim=64)

    def forward(x: Tensor) -> Tensor:
        out: Tensor = module(x)
        return out

    batch = Tensor(np.ones((64, 64), np.float32))
    for _ in range(10):  # warm-up
        record_forward(forward, (batch,))
        discard_all()
    gc.collect()
    before = rss_bytes()
    for _ in range(count):
        record_forward(forward, (Tensor(np.ones((64, 64), np.float32)),))
        if release:
            discard_all()
    gc.collect()
    return rss_bytes() - before


@pytest.mark.soak
@pytest.mark.timeout(600)
def test_discard_all_is_needed() -> None:
    count = max(100, SOAK_RUNS * 5)
    released = _abandon_records(count, release=True)
    kept = _abandon_records(count, release=False)
    # Measured here: ~5 KB vs ~156 KB per abandoned record (a 64-wide MLP stage).
    assert kept > 4 * max(released, 0) + 2 * MB, (kept, released)
