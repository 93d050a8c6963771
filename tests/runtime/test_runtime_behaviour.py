"""The runtime's contract beyond numerics: repeated runs, composites, logs, trace."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import Counter
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
from stage_runs import stage_runs_holding_chunks
from structlog.testing import capture_logs

from ppswap import (
    PipelineStage,
    Schedule1F1B,
    ScheduleInterleaved1F1B,
    run_schedule,
)
from ppswap.actors.compute import JOB_KINDS
from ppswap.core.faults import FaultPlan, delay_message
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.steps import StepKind
from ppswap.scheduler.swap_plan import chunks_on_host_peak, compute_slots, eligible_chunks
from ppswap.swap import EmulatedDevice, swap_wrapper

DIM = 8


def _stages(stage_num: int) -> list[PipelineStage]:
    modules = build_mlp_stages(stage_num, dim=DIM, wrap=swap_wrapper)
    return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]


def _data(batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    return (
        rng.standard_normal((batch, DIM)).astype(np.float32),
        rng.standard_normal((batch, DIM)).astype(np.float32),
    )


def _ppswap_threads(before: Sequence[threading.Thread] = ()) -> list[str]:
    """ppswap's threads alive now, but those in ``before`` (another test's transport may
    keep idle waiting threads until it is closed)."""
    return [
        t.name for t in threading.enumerate() if t.name.startswith("ppswap-") and t not in before
    ]


class _RankPoolDevice(EmulatedDevice):
    """An EmulatedDevice that also counts the host buffers each rank holds at once.

    Buffers are taken on a rank's copy thread (``ppswap-copy-<rank>``); that rank is
    charged for a buffer until it comes back, whichever thread gives it back.
    """

    def __init__(self) -> None:
        super().__init__()
        self._track = threading.Lock()
        self._owner: dict[int, int] = {}
        self.held: Counter[int] = Counter()
        self.peak: Counter[int] = Counter()
        self.taken: Counter[int] = Counter()

    def acquire_host(self, nbytes: int) -> np.ndarray:
        name = threading.current_thread().name
        assert name.startswith("ppswap-copy-"), f"host buffer taken on {name}"
        rank = int(name.removeprefix("ppswap-copy-"))
        buf = super().acquire_host(nbytes)
        with self._track:
            self._owner[id(_root(buf))] = rank
            self.held[rank] += 1
            self.taken[rank] += 1
            self.peak[rank] = max(self.peak[rank], self.held[rank])
        return buf

    def release_host(self, buf: np.ndarray) -> None:
        with self._track:
            rank = self._owner.pop(id(_root(buf)))
            self.held[rank] -= 1
        super().release_host(buf)


def _root(buf: np.ndarray) -> np.ndarray:
    while isinstance(buf.base, np.ndarray):
        buf = buf.base
    return buf


@pytest.mark.asyncio
async def test_ten_runs_in_a_row_leave_nothing_behind() -> None:
    """Ten runs of one schedule: same gradients, and no buffer, group, chunk, thread or
    task left behind. The host pool, shared by the ranks and kept across runs, holds at
    most what the plan's worst case needs at once and is reused, never regrown: how many
    buffers the ranks need *at the same time* depends on how their copies overlap (timing),
    so the bound is computed from the plan, per rank, not taken from the first run.
    Interleaved pp2 vpp2: a rank waits for a chunk's load before its last offloads, so the
    bound is below one buffer per copy even with loads on a thread of their own (under
    GPipe every chunk of a run may be on host at once)."""
    stages = _stages(4)
    device = _RankPoolDevice()
    schedule = ScheduleInterleaved1F1B(
        stages, micro_batch_num=4, loss_fn=mse_loss, swap=True, device=device, pp=2
    )
    orders = build_all_orders(
        ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=4, swap=True)
    )
    offloads = [sum(s.kind is StepKind.SWAP_LAUNCH_OFFLOAD for s in o) for o in orders]
    x, y = _data()
    tasks_before = _other_tasks()
    threads_before = threading.enumerate()
    first_grads = None
    per_run: list[int] = []  # buffers each rank takes in one run: the same every run
    for run in range(1, 11):
        taken_before = dict(device.taken)
        result = await schedule.run_async(x, targets=y)
        assert result.generation == run
        assert all(s.generation == run for s in stages)
        assert stage_runs_holding_chunks() == 0
        for rank in result.ranks:
            assert rank.offloaded_bytes > 0
            assert rank.groups_left == 0
            assert rank.saved_bytes_left == 0
            assert rank.copies == 2 * offloads[rank.rank]  # the plan the bound is taken from
        grads = [g.asnumpy() for s in stages for g in s.grads]
        if first_grads is None:
            first_grads = grads
        else:
            # Same weights, same data: every run gives the same gradients.
            for g0, g1 in zip(first_grads, grads, strict=True):
                np.testing.assert_array_equal(g0, g1)
        assert _ppswap_threads(threads_before) == []
        assert _other_tasks() == tasks_before

        taken = [device.taken[r] - taken_before.get(r, 0) for r in range(len(orders))]
        if not per_run:
            per_run = taken
            # Every chunk of a rank is one equal stage on equal micro-batches: same buffers.
            assert all(t > 0 and t % n == 0 for t, n in zip(taken, offloads, strict=True))
            per_chunk = [t // n for t, n in zip(taken, offloads, strict=True)]
            bound = [chunks_on_host_peak(o) * k for o, k in zip(orders, per_chunk, strict=True)]
            assert sum(bound) < sum(taken)  # the bound is tighter than "one buffer per copy"
        assert taken == per_run
        # Nothing in use after the run; no rank ever held more than its plan allows.
        pool = device.pool_stats()
        assert pool.lent == 0 and pool.bytes_lent == 0
        assert all(device.held[r] == 0 for r in range(len(orders)))
        assert all(device.peak[r] <= bound[r] for r in range(len(orders))), (device.peak, bound)
        # Every buffer ever allocated is back in the pool (none lost, none freed), and
        # no more were ever allocated than the ranks can hold at once: the pool is reused.
        assert pool.buffers == pool.misses <= sum(bound), (pool, bound)
        assert pool.hits + pool.misses == run * sum(per_run)
    assert device.pool_stats().hits > 0


@pytest.mark.asyncio
async def test_runs_without_a_device_reuse_the_stages_engine() -> None:
    """run_schedule without ``device``: the first stage's kept engine moves every step,
    so the host buffers and device blocks pooled in one step serve the next.

    Not "later steps allocate nothing": both ranks' copy threads share the pools, and how
    their acquisitions and returns interleave decides how many buffers are out at once,
    so a later step may need a few more than the first had (about 1 run in 6 did)."""
    stages = _stages(2)
    x, y = _data()
    engine = stages[0].default_copy_engine()
    assert stages[0].default_copy_engine() is engine
    counts = [(0, 0, 0, 0)]  # host hits and misses, block hits and misses, after each step
    for _ in range(3):
        result = await run_schedule(
            stages, micro_batch_num=4, inputs=x, targets=y, loss_fn=mse_loss, swap=True
        )
        assert sum(r.offloaded_bytes for r in result.ranks) > 0
        host, blocks = engine.pool_stats(), engine.block_stats()
        assert host.lent == 0 and blocks.lent == 0  # every buffer and block came back
        counts.append((host.hits, host.misses, blocks.hits, blocks.misses))
    steps = [
        tuple(b - a for a, b in zip(before, after, strict=True))
        for before, after in pairwise(counts)
    ]
    first = steps[0]
    assert first[1] > 0 and first[3] > 0  # the copies ran through this engine
    for host_hits, host_misses, block_hits, block_misses in steps[1:]:
        # every step takes as many buffers and blocks as the first (the same plan) ...
        assert host_hits + host_misses == first[0] + first[1]
        assert block_hits + block_misses == first[2] + first[3]
        # ... and the pools, filled by the steps before, serve most of them
        assert host_hits > host_misses and block_hits > block_misses


@pytest.mark.asyncio
async def test_only_ranks_that_copy_start_a_copy_thread() -> None:
    """A rank whose order launches no copy (every rank without swap) runs without a copy
    thread; with swap, exactly the ranks whose plan offloads have one."""
    stages = _stages(4)
    x, y = _data()
    seen: list[set[str]] = []

    def loss(output: Any, target: Any) -> Any:  # runs on the compute thread, mid-run
        seen.append({t.name for t in threading.enumerate() if t.name.startswith("ppswap-copy")})
        return mse_loss(output, target)

    await run_schedule(stages, "1f1b", micro_batch_num=8, inputs=x, targets=y, loss_fn=loss)
    assert len(seen) == 8 and all(names == set() for names in seen)
    seen.clear()
    result = await run_schedule(
        stages, "1f1b", micro_batch_num=8, inputs=x, targets=y, loss_fn=loss, swap=True
    )
    orders = build_all_orders(ScheduleConfig(schedule="1f1b", pp=4, micro=8, swap=True))
    planned = {f"ppswap-copy-{r}" for r, order in enumerate(orders) if eligible_chunks(order)}
    assert 0 < len(planned) < 4  # 1F1B: the last ranks' gaps are too short to swap
    assert {f"ppswap-copy-{r.rank}" for r in result.ranks if r.copies > 0} == planned
    assert len(seen) == 8 and all(names == planned for names in seen)


def _other_tasks() -> set[asyncio.Task[Any]]:
    current = asyncio.current_task()
    return {t for t in asyncio.all_tasks() if t is not current and not t.done()}


@pytest.mark.asyncio
async def test_composite_leaves_run_as_joined_tasks(tmp_path: Path) -> None:
    """In OVERLAP_B_F(B_i, F_j) on rank 0 of 1F1B pp2, B_i waits for a gradient that
    arrives late; F_j must not wait for it, and the composite ends after both (in its
    batch the leaf whose input comes first runs first, ``BatchRun.pairs``)."""
    stages = _stages(2)
    x, y = _data()
    delay = 0.5
    # the gradient for B0 on stage 0 (rank 0), sent by rank 1
    late = FaultPlan((delay_message(delay, StepKind.SEND_B, rank=1, micro=0),))
    result = await run_schedule(
        stages,
        "1f1b",
        micro_batch_num=4,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        overlap_b_f=True,
        faults=late,
        trace=tmp_path / "t.json",
    )
    assert result.losses
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and e["pid"] == 0 and e["tid"] == 0]
    composite = next(e for e in spans if e["name"].startswith("OBF[B0.0"))
    back = next(e for e in spans if e["name"] == "B0.0")
    fwd_name = composite["name"].split("+")[1].rstrip("]")
    fwd = next(e for e in spans if e["name"] == fwd_name)
    end = lambda e: e["ts"] + e["dur"]  # noqa: E731
    assert end(fwd) < end(back) - delay * 1e6 / 2  # F finished long before B could
    assert end(composite) >= max(end(fwd), end(back))
    assert composite["ts"] <= min(fwd["ts"], back["ts"])


@pytest.mark.asyncio
async def test_logs_carry_rank_actor_and_step_fields() -> None:
    stages = _stages(2)
    x, y = _data()
    with capture_logs() as logs:
        result = await run_schedule(
            stages,
            "gpipe",
            micro_batch_num=4,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=True,
            # Copies of 0.1 s each: every SWAP_WAIT_LOAD of rank 0 waits (its loads are
            # launched one forward or backward of a tiny model before they are needed).
            device=EmulatedDevice(h2d_gbps=2e-6),
        )
    steps = [e for e in logs if e["event"] == "step"]
    assert {e["rank"] for e in steps} == {0, 1}
    assert all(e["actor"] == "compute" for e in steps)
    assert all({"step", "stage", "micro", "generation"} <= e.keys() for e in steps)
    waits = [e for e in logs if e["event"] == "swap_wait"]
    assert waits and all(e["bytes"] > 0 and e["waited_s"] >= 0 for e in waits)
    # The waits logged are the exposed copy wait the ranks report.
    for rank, stats in enumerate(result.ranks):
        logged = sum(e["waited_s"] for e in waits if e["rank"] == rank)
        assert logged == pytest.approx(stats.exposed_copy_wait_s)
    assert max(e["waited_s"] for e in waits if e["step"] == "SWAP_WAIT_LOAD") > 0.05
    copies = [e for e in logs if e["event"] == "copy"]
    assert copies and all(e["actor"] == "copy" for e in copies)
    p2p = [e for e in logs if e.get("actor") == "p2p"]
    assert {e["event"] for e in p2p} == {"send", "recv"}


@pytest.mark.asyncio
async def test_trace_has_a_lane_per_rank_and_actor(tmp_path: Path) -> None:
    stages = _stages(2)
    x, y = _data()
    path = tmp_path / "run.json"
    result = await run_schedule(
        stages,
        "gpipe",
        micro_batch_num=4,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=True,
        trace=path,
    )
    assert result.trace_path == path
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    assert lanes == {(r, a) for r in (0, 1) for a in ("compute", "p2p", "copy")}
    copy_spans = [e for e in events if e.get("ph") == "X" and e["tid"] == 2]
    assert {e["name"] for e in copy_spans} == {"SWAP_LAUNCH_OFFLOAD", "SWAP_LAUNCH_LOAD"}
    compute_spans = [e for e in events if e.get("ph") == "X" and e["tid"] == 0]
    assert len(compute_spans) == sum(r.steps_executed for r in result.ranks)


@pytest.mark.asyncio
async def test_event_loop_stays_responsive_while_training() -> None:
    """MindSpore work never runs on the loop: a heartbeat keeps ticking. (The p99 figure
    is measured by benchmarks/bench_runtime.py; here only a gross stall would fail.)"""
    stages = _stages(4)
    x, y = _data()
    lags: list[float] = []

    async def heartbeat() -> None:
        while True:
            started = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - started - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        schedule = Schedule1F1B(stages, micro_batch_num=8, loss_fn=mse_loss, swap=True)
        await schedule.run_async(x, targets=y)
        tg.cancel_scope.cancel()
    assert len(lags) > 10
    assert max(lags) < 1.0


@pytest.mark.asyncio
async def test_compute_jobs_are_counted_and_timed_per_kind() -> None:
    """RankStats.compute_jobs matches the leaves and swap steps of each rank's order; the
    times are spent on the compute thread, so together they fit inside the step."""
    x, y = _data()
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=4, split_dw=True, swap=True)
    result = await run_schedule(
        _stages(2),
        "gpipe",
        micro_batch_num=4,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        split_dw=True,
        swap=True,
    )
    kinds_seen: set[str] = set()
    for rank, order in enumerate(build_all_orders(config)):
        stats = result.ranks[rank]
        leaves = Counter(leaf.kind for slot in compute_slots(order) for leaf in slot.leaves)
        launches = sum(1 for step in order if step.kind.name.startswith("SWAP_LAUNCH"))
        expected = {
            "forward": leaves[StepKind.FWD],
            "backward": leaves[StepKind.BWD],
            "backward_input": leaves[StepKind.BWD_INPUT],
            "backward_weight": leaves[StepKind.BWD_WEIGHT],
            "swap_prepare": launches,
            "swap_finish": launches,
            "recompute": 0,  # nothing is recompute-wrapped here: test_recompute_wrapper counts it
        }
        assert dict(stats.compute_jobs) == expected
        kinds_seen.update(kind for kind, count in expected.items() if count)
        for kind, count in expected.items():
            assert (stats.compute_job_s[kind] > 0) == (count > 0), kind
    assert kinds_seen == set(JOB_KINDS) - {"recompute"}  # the case exercises every other kind
    total = sum(sum(rank.compute_job_s.values()) for rank in result.ranks)
    assert total < result.step_time_s  # one compute thread serves every rank
