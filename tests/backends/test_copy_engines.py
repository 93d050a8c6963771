"""The copy engines offer the same public methods, and a rank's copy stream runs loads
and offloads on threads of their own (a load never waits behind an offload)."""

from __future__ import annotations

import inspect
import subprocess
import sys
import threading
from pathlib import Path

import anyio
import pytest

from ppswap.actors.copy_stream import CopyStream
from ppswap.actors.trace import FlightRecorder
from ppswap.backends.base import CopyEngine
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.scheduler.steps import MetaStep, StepKind
from ppswap.swap.jobs import CopyJob, JobKind

torch_engine = pytest.importorskip("ppswap.backends.torch.cuda_engine")

ROOT = Path(__file__).parents[2]


def _public_methods(cls: type) -> set[str]:
    return {
        name
        for name, value in inspect.getmembers(cls)
        if not name.startswith("_") and (callable(value) or isinstance(value, property))
    }


# What one engine has beyond the others, and why: EmulatedDevice's single-array copies
# and its cached "device" blocks (CUDA's are the caching allocator's).
_EMULATED_ONLY = {"d2h", "d2h_into", "block_stats", "max_pool_bytes"}


def test_every_engine_offers_the_protocol_and_the_same_pool_methods() -> None:
    protocol = {
        name
        for name in dir(CopyEngine)
        if not name.startswith("_") and name not in dir(object) and name != "pinned"
    }
    assert {"clear_pool", "check_devices", "can_move", "d2h_many"} <= protocol
    emulated = _public_methods(EmulatedDevice)
    cuda = _public_methods(torch_engine.CudaCopyEngine)
    shared = {"pool_stats", "counters", "clear_pool"}
    assert protocol | shared <= emulated
    assert protocol | shared <= cuda
    assert emulated - cuda == _EMULATED_ONLY
    assert cuda - emulated == set()


def test_clear_pool_frees_the_idle_host_buffers() -> None:
    engine = EmulatedDevice()
    buffer = engine.acquire_host(10_000)
    engine.release_host(buffer)
    assert engine.pool_stats().buffers == 1
    engine.clear_pool()
    assert engine.pool_stats().buffers == 0


def _gated_jobs(gate: threading.Event) -> tuple[CopyJob, CopyJob, list[str]]:
    order: list[str] = []

    def offload() -> None:
        if not gate.wait(10):
            raise TimeoutError("the gate was never opened")
        order.append("offload")

    def load() -> None:
        order.append("load")

    return (
        CopyJob(kind=JobKind.OFFLOAD, group="a", nbytes=1, work=offload),
        CopyJob(kind=JobKind.LOAD, group="b", nbytes=1, work=load),
        order,
    )


async def _run_gated(split: bool) -> tuple[bool, list[str], set[str]]:
    """Launch an offload held at a gate, then a load: whether the load finished while the
    offload was held, the order they ended in, and the copy threads' names."""
    gate = threading.Event()
    offload, load, order = _gated_jobs(gate)
    stream = CopyStream(3, FlightRecorder(), split_directions=split)
    stream.start()
    try:
        names = {t.name for t in threading.enumerate() if t.name.startswith("ppswap-")}
        held = stream.launch(MetaStep(StepKind.SWAP_LAUNCH_OFFLOAD, 0, 0), offload)
        loaded = stream.launch(MetaStep(StepKind.SWAP_LAUNCH_LOAD, 1, 0), load)
        early = await loaded.wait_async(0.3)
        gate.set()
        assert await held.wait_async(10) and await loaded.wait_async(10)
    finally:
        gate.set()
        stream.close()
        with anyio.fail_after(10):
            await stream.finished()
        await stream.join(10)
    assert stream.stats().copies == 2
    return early, order, names


@pytest.mark.asyncio
async def test_a_load_does_not_wait_behind_an_offload_on_two_copy_streams() -> None:
    early, order, names = await _run_gated(split=True)
    assert early and order == ["load", "offload"]
    assert names == {"ppswap-copy-3", "ppswap-load-3"}


@pytest.mark.asyncio
async def test_one_copy_stream_runs_them_in_launch_order() -> None:
    early, order, names = await _run_gated(split=False)
    assert not early and order == ["offload", "load"]
    assert names == {"ppswap-copy-3"}


def test_the_copy_streams_benchmark_runs() -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_copy_streams.py"),
            "--rounds",
            "2",
            "--offload-mib",
            "4",
            "--load-mib",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    rows = [
        line
        for line in done.stdout.splitlines()
        if line.startswith("| 1 ") or line.startswith("| 2 ")
    ]
    assert len(rows) == 2, done.stdout


@pytest.mark.asyncio
async def test_a_copy_cancelled_unrun_after_a_failure_carries_that_failure() -> None:
    """An offload queued behind a held one, when a load fails meanwhile, never runs; a wait
    on it raises the load's failure (the root cause), not a consequence of the missing copy."""
    gate, running = threading.Event(), threading.Event()
    order: list[str] = []

    def hold() -> None:
        running.set()
        if not gate.wait(10):
            raise TimeoutError("the gate was never opened")
        order.append("offload")

    def fail() -> None:
        raise OSError("host buffer gone")

    held_job = CopyJob(kind=JobKind.OFFLOAD, group="a", nbytes=1, work=hold)
    queued_job = CopyJob(kind=JobKind.OFFLOAD, group="c", nbytes=1, work=lambda: None)
    failing_job = CopyJob(kind=JobKind.LOAD, group="b", nbytes=1, work=fail)
    stream = CopyStream(3, FlightRecorder(), split_directions=True)
    stream.start()
    try:
        held = stream.launch(MetaStep(StepKind.SWAP_LAUNCH_OFFLOAD, 0, 0), held_job)
        assert await anyio.to_thread.run_sync(running.wait, 10)  # the held copy is running
        queued = stream.launch(MetaStep(StepKind.SWAP_LAUNCH_OFFLOAD, 1, 0), queued_job)
        failed = stream.launch(MetaStep(StepKind.SWAP_LAUNCH_LOAD, 2, 0), failing_job)
        assert await failed.wait_async(10)
        gate.set()
        assert await held.wait_async(10) and await queued.wait_async(10)
    finally:
        gate.set()
        stream.close()
        with anyio.fail_after(10), pytest.raises(Exception) as raised:
            await stream.finished()
        await stream.join(10)
    assert order == ["offload"]  # the held copy ran; the queued one did not
    assert failed.error is not None and (failed.error.actor, failed.error.step) == ("copy", "LL0.2")
    assert queued.error is failed.error
    assert raised.value is failed.error
    assert stream.stats().copies == 1
