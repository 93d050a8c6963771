"""Measuring for ``gpu_check.py``: the pipeline and unsplit runs of a model on one
device, their step times and peak device memory, the copies' CUDA-event timing, the
plan's prediction and the machine's copy and matmul rates. Every result is a figure
(``Json``: plain numbers, None where the device has none, e.g. memory on CPU); nothing
here judges one: ``gpu_report.py`` turns the figures into targets and markdown.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, TypeVar

import anyio
import torch
from gpu_model import ModelSize, Settings, build_modules, lm_loss, make_batch
from torch import nn

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.backends.base import CopyEngine
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.backends.torch.cuda_engine import CudaCopyEngine, CudaSource
from ppswap.backends.types import HostArray
from ppswap.results import RankStats
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.simulate import build_timeline, memory_table, resident_by_column

__all__ = [
    "SCHEDULE",
    "STEP_TIMEOUT_S",
    "Clock",
    "CopySpan",
    "Json",
    "Pipeline",
    "TimedCudaCopyEngine",
    "clear_engine",
    "grad_norms",
    "make_engine",
    "max_rel_diff",
    "measure_unsplit",
    "plan_prediction",
    "probe",
    "rank_json",
    "release_device",
    "step_figures",
    "timed",
    "unsplit_step",
]

T = TypeVar("T")
Json = dict[str, Any]

SCHEDULE: Final = "gpipe"
STEP_TIMEOUT_S = 120.0


# -- the timed copy engine -----------------------------------------------------------------


def _timing_event() -> torch.cuda.Event:
    event: torch.cuda.Event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    return event


@dataclass(frozen=True)
class CopySpan:
    """One copy on the copy stream: direction, bytes, and its start and end events."""

    kind: str
    nbytes: int
    start: torch.cuda.Event
    end: torch.cuda.Event


class TimedCudaCopyEngine(CudaCopyEngine):
    """``CudaCopyEngine`` whose copies record CUDA events on their copy stream.

    Each copy thread has its own D2H and H2D streams (the engine's); a job gets a start
    event after its stream's wait for the forward's ``ready`` event and an end event after
    the copy, so a span is the copy, not the wait for compute (the end event is recorded
    once the engine's own wait for the copy returns: a span also holds one host round trip,
    tens of microseconds against copies of milliseconds). ``spans()`` needs the device
    synchronized. Used only for the instrumented step.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._lock = threading.Lock()
        self._spans: list[CopySpan] = []

    def _timed(self, kind: str, nbytes: int, stream: Any, run: Callable[[], Any]) -> Any:
        start, end = _timing_event(), _timing_event()
        start.record(stream)
        result = run()
        end.record(stream)
        with self._lock:
            self._spans.append(CopySpan(kind, nbytes, start, end))
        return result

    def d2h_many(
        self, sources: Sequence[CudaSource], into: Sequence[HostArray | None] | None = None
    ) -> list[HostArray]:
        stream = self.streams.of_this_thread("d2h")
        for ready in {id(source.ready): source.ready for source in sources}.values():
            stream.wait_event(ready)
        nbytes = sum(s.nbytes for s in sources)
        hosts: list[HostArray] = self._timed(
            "d2h", nbytes, stream, lambda: super(TimedCudaCopyEngine, self).d2h_many(sources, into)
        )
        return hosts

    def h2d_block(
        self, hosts: Sequence[HostArray], offsets: Sequence[int], nbytes: int
    ) -> list[torch.Tensor]:
        stream = self.streams.of_this_thread("h2d")
        moved = sum(int(h.nbytes) for h in hosts)
        loaded: list[torch.Tensor] = self._timed(
            "h2d",
            moved,
            stream,
            lambda: super(TimedCudaCopyEngine, self).h2d_block(hosts, offsets, nbytes),
        )
        return loaded

    def h2d(
        self, host: HostArray, strides: tuple[int, ...] | None = None, dtype: str | None = None
    ) -> torch.Tensor:
        stream = self.streams.of_this_thread("h2d")
        fresh: torch.Tensor = self._timed(
            "h2d",
            int(host.nbytes),
            stream,
            lambda: super(TimedCudaCopyEngine, self).h2d(host, strides, dtype),
        )
        return fresh

    def spans(self) -> list[tuple[str, int, float]]:
        """``(kind, bytes, seconds)`` per copy so far."""
        with self._lock:
            spans = list(self._spans)
        return [(s.kind, s.nbytes, s.start.elapsed_time(s.end) / 1e3) for s in spans]


# -- measuring -----------------------------------------------------------------------------


@dataclass
class Clock:
    """The run's time budget: sections that would start after ``budget_s`` are skipped."""

    budget_s: float
    started: float = field(default_factory=time.perf_counter)

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def exhausted(self) -> bool:
        return self.elapsed() > self.budget_s


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def release_device(device: torch.device) -> None:
    """Collect garbage, give the caching allocator's free blocks back and reset its peak
    statistics (CUDA): each section starts from the same allocator state, so its step
    times hold no ``cudaFree`` of an earlier section's cache."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def allocator_figures(device: torch.device) -> Json:
    """The caching allocator since the last ``release_device``: peak allocated and
    reserved bytes and its retries (a retry frees the cache and allocates again: a stall);
    None on CPU."""
    if device.type != "cuda":
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None, "alloc_retries": None}
    stats = torch.cuda.memory_stats(device)
    return {
        "peak_allocated_bytes": int(torch.cuda.max_memory_allocated(device)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(device)),
        "alloc_retries": int(stats.get("num_alloc_retries", 0)),
    }


def pinned_host_bytes(engine: CopyEngine) -> int | None:
    """Page-locked (or, on CPU, plain) host bytes the engine's pool holds or lends."""
    stats = getattr(engine, "pool_stats", None)
    if stats is None:
        return None
    pool = stats()
    return int(pool.bytes_held + pool.bytes_lent)


def hidden_syncs(fn: Callable[[], object], device: torch.device) -> Json:
    """``fn()`` (one step) under ``torch.cuda.set_sync_debug_mode("warn")``: each
    synchronizing call torch reports, by message (its first line), with a count."""
    if device.type != "cuda":
        return {"checked": False, "syncs": None, "by_message": {}}
    caught: list[str] = []
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        caught = [str(w.message).splitlines()[0][:200] for w in found]
    by_message: dict[str, int] = {}
    for message in caught:
        by_message[message] = by_message.get(message, 0) + 1
    return {"checked": True, "syncs": len(caught), "by_message": by_message}


def timed(fn: Callable[[], T], device: torch.device) -> tuple[T, float, int | None]:
    """``fn()``, its wall time between device synchronizes, and the device's peak
    allocated bytes while it ran (None on CPU)."""
    _sync(device)
    _reset_peak(device)
    started = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - started, _peak(device)


def step_figures(
    times: Sequence[float],
    peaks: Sequence[int | None],
    losses: Sequence[float],
    device: torch.device,
) -> Json:
    """Step times (the warm-up excluded by the caller), their median, the last step's peak
    allocated bytes and the allocator's peak reserved bytes since that step started (call
    it right after the last step)."""
    reserved = int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None
    return {
        "step_s": [round(t, 6) for t in times],
        "median_step_s": statistics.median(times) if times else None,
        "peak_bytes": peaks[-1] if peaks else None,
        "peak_reserved_bytes": reserved,
        "losses": list(losses),
    }


def grad_norms(stages: Sequence[PipelineStage]) -> list[float]:
    """The float64 norm of every gradient of every stage, in order (to compare runs)."""
    norms = [torch.linalg.vector_norm(g.detach().double()) for s in stages for g in s.grads]
    return [float(n) for n in torch.stack(norms).cpu()] if norms else []


def max_rel_diff(a: Sequence[float], b: Sequence[float]) -> float | None:
    if len(a) != len(b) or not a:
        return None
    return max(abs(x - y) / max(abs(x), abs(y), 1e-30) for x, y in zip(a, b, strict=True))


def rank_json(stats: RankStats) -> Json:
    return {
        "rank": stats.rank,
        "peak_saved_bytes": stats.peak_saved_bytes,
        "offloaded_bytes": stats.offloaded_bytes,
        "loaded_bytes": stats.loaded_bytes,
        "copies": stats.copies,
        "copy_busy_s": stats.copy_busy_s,
        "exposed_copy_wait_s": stats.exposed_copy_wait_s,
        "groups_left": stats.groups_left,
    }


class Pipeline:
    """The stages of one model size on one device and the runs over them."""

    def __init__(self, size: ModelSize, settings: Settings) -> None:
        self.size = size
        self.device = settings.device
        self.settings = settings
        self.modules = build_modules(size, settings)
        self.stages = [PipelineStage(m, i, size.pp) for i, m in enumerate(self.modules)]
        self.tokens, self.targets = make_batch(size)

    def run(self, *, swap: bool, engine: CopyEngine) -> RunResult:
        for module in self.modules:  # as an optimizer's zero_grad would: a run sets .grad
            module.zero_grad(set_to_none=True)
        call = partial(
            run_schedule,
            self.stages,
            SCHEDULE,
            micro_batch_num=self.size.micro,
            inputs=self.tokens,
            targets=self.targets,
            loss_fn=lm_loss,
            swap=swap,
            device=engine,
            step_timeout=STEP_TIMEOUT_S,
        )
        with self.settings.mixed():  # on the thread that runs the loop: the run reads it
            return anyio.run(call)

    def measure(self, *, swap: bool, engine: CopyEngine, steps: int) -> tuple[Json, RunResult]:
        """A warm-up step, then ``steps`` timed steps; the figures and the last result."""
        self.run(swap=swap, engine=engine)
        times: list[float] = []
        peaks: list[int | None] = []
        losses: list[float] = []
        last: RunResult | None = None
        for _ in range(steps):
            result, seconds, peak = timed(partial(self.run, swap=swap, engine=engine), self.device)
            times.append(seconds)
            peaks.append(peak)
            losses.append(result.loss)
            last = result
        assert last is not None
        result = last
        figures = step_figures(times, peaks, losses, self.device)
        figures["ranks"] = [rank_json(r) for r in result.ranks]
        figures["grad_norms"] = grad_norms(self.stages)
        return figures, result

    def drop_stages(self) -> None:
        """Forget the stages (their accumulated gradients); the modules stay."""
        self.stages = []


def make_engine(device: torch.device, *, timed_copies: bool = False) -> CopyEngine:
    """The persistent copy engine of a device: CUDA (timed or as shipped) or CPU."""
    if device.type == "cuda":
        if timed_copies:
            return TimedCudaCopyEngine(device)
        return CudaCopyEngine(device)
    return EmulatedDevice()


def clear_engine(engine: CopyEngine) -> None:
    """Give the engine's idle host buffers back (to torch's pinned cache on CUDA)."""
    engine.clear_pool()


def unsplit_step(
    model: nn.Module,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    *,
    offload: bool,
    settings: Settings,
) -> float:
    """One forward and backward of the whole batch; ``offload``: under ``save_on_cpu``;
    the forward under ``settings``' autocast, if any."""
    for param in model.parameters():
        param.grad = None
    saving = (
        torch.autograd.graph.save_on_cpu(pin_memory=True) if offload else contextlib.nullcontext()
    )
    with saving, settings.mixed():
        loss = lm_loss(model(tokens), targets)
    torch.autograd.backward(loss)
    return float(loss.detach())


def measure_unsplit(pipeline: Pipeline, *, offload: bool, steps: int) -> Json:
    """The pipeline's modules chained, the whole batch at once (warm-up + ``steps``)."""
    device = pipeline.device
    model = nn.Sequential(*pipeline.modules)
    tokens = torch.from_numpy(pipeline.tokens).to(device)
    targets = torch.from_numpy(pipeline.targets).to(device)
    step = partial(
        unsplit_step, model, tokens, targets, offload=offload, settings=pipeline.settings
    )
    step()
    times: list[float] = []
    peaks: list[int | None] = []
    losses: list[float] = []
    for _ in range(steps):
        loss, seconds, peak = timed(step, device)
        times.append(seconds)
        peaks.append(peak)
        losses.append(loss)
    figures = step_figures(times, peaks, losses, device)
    for param in model.parameters():
        param.grad = None
    return figures


def probe(device: torch.device) -> Json:
    """Rates the sizing rests on: pinned host <-> device copy bandwidth and fp32 matmul
    throughput (a few repetitions each; tiny sizes on CPU)."""
    cuda = device.type == "cuda"
    nbytes = 256 * 2**20 if cuda else 8 * 2**20
    n = 8192 if cuda else 256
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    reps = 5

    def rate(fn: Callable[[], object]) -> float:
        fn()
        _sync(device)
        started = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        return (time.perf_counter() - started) / reps

    d2h = rate(lambda: host.copy_(dev, non_blocking=True))
    h2d = rate(lambda: dev.copy_(host, non_blocking=True))
    mm = rate(lambda: a @ b)
    return {
        "pinned": cuda,
        "d2h_gbps": nbytes / d2h / 1e9,
        "h2d_gbps": nbytes / h2d / 1e9,
        "matmul_fp32_tflops": 2 * n**3 / mm / 1e12,
    }


# -- the plan ------------------------------------------------------------------------------


def plan_prediction(
    size: ModelSize,
    no_swap: Sequence[Json],
    swap: Sequence[Json],
    measured_no_swap: float,
    *,
    one_device: bool,
) -> Json:
    """The plan's peak with swap in bytes (``gpu_check.py``'s docstring, item 2).

    ``no_swap`` / ``swap``: per-rank figures (``rank_json``) of the two runs;
    ``measured_no_swap``: the measured peak without swap the prediction starts from;
    ``one_device``: every rank on one device (the planned peak is the largest per-column
    sum over ranks), else each rank on its own (the per-rank planned peaks summed).
    """
    config = ScheduleConfig(schedule=SCHEDULE, pp=size.pp, micro=size.micro, swap=True)
    table = memory_table(config)
    ranks: list[Json] = []
    chunk_bytes: list[float] = []
    movable_bytes: list[float] = []
    for row, off, on in zip(table, no_swap, swap, strict=True):
        chunks_off, chunks_on, eligible = (
            row["peak_chunks_no_swap"],
            row["peak_chunks_swap"],
            row["eligible"],
        )
        per_chunk = off["peak_saved_bytes"] / chunks_off if chunks_off else 0.0
        movable = min(on["offloaded_bytes"] / eligible, per_chunk) if eligible else 0.0
        chunk_bytes.append(per_chunk)
        movable_bytes.append(movable)
        ranks.append(
            {
                "rank": row["rank"],
                "chunks_no_swap": chunks_off,
                "chunks_swap": chunks_on,
                "eligible": eligible,
                "chunk_bytes": per_chunk,
                "movable_chunk_bytes": movable,
                "predicted_saved_swap": chunks_on * movable + chunks_off * (per_chunk - movable),
                "measured_saved_no_swap": off["peak_saved_bytes"],
                "measured_saved_swap": on["peak_saved_bytes"],
            }
        )
    if one_device:
        orders = build_all_orders(config)
        timeline = build_timeline(config, orders)
        on_cols = [resident_by_column(timeline, r, o) for r, o in enumerate(orders)]
        off_cols = [
            resident_by_column(timeline, r, o, with_swap=False) for r, o in enumerate(orders)
        ]
        planned_off = max(
            sum(off_cols[r][t] * chunk_bytes[r] for r in range(len(orders)))
            for t in range(timeline.num_columns)
        )
        planned_on = max(
            sum(
                on_cols[r][t] * movable_bytes[r]
                + off_cols[r][t] * (chunk_bytes[r] - movable_bytes[r])
                for r in range(len(orders))
            )
            for t in range(timeline.num_columns)
        )
        chunks_off = max(sum(col) for col in zip(*off_cols, strict=True))
        chunks_on = max(sum(col) for col in zip(*on_cols, strict=True))
    else:
        planned_off = sum(r["chunks_no_swap"] * r["chunk_bytes"] for r in ranks)
        planned_on = sum(r["predicted_saved_swap"] for r in ranks)
        chunks_off = sum(r["chunks_no_swap"] for r in ranks)
        chunks_on = sum(r["chunks_swap"] for r in ranks)
    return {
        "one_device": one_device,
        "peak_chunks_no_swap": chunks_off,
        "peak_chunks_swap": chunks_on,
        "planned_saved_no_swap": planned_off,
        "planned_saved_swap": planned_on,
        "predicted_peak_swap": measured_no_swap - planned_off + planned_on,
        "ranks": ranks,
    }
