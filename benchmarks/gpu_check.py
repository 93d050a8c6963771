"""One prepared check for a lent GPU: ppswap's swap on a GPT-like model, every pipeline
rank on the one GPU, against no swap, the plan, and ``torch.autograd.graph.save_on_cpu``.

    bash benchmarks/gpu_run.sh                  # on the lent machine (docs/gpu.md)
    python benchmarks/gpu_check.py --cpu        # the same code path, a tiny model, on CPU

Contract: it runs the configurations below in one process, writes every figure as JSON
(``--json``, default ``<--out>/gpu_check.json``, rewritten after each section so a run
that is cut short still leaves what it measured) and as a markdown table (printed and
written to ``<--out>/gpu_check.md``), prints one PASS / FAIL / SKIP line per target and
exits 0 unless the arguments are bad: a target missed is a figure, not an error. A section
that raises (out of memory, a bug) is recorded with its error and the rest still runs;
sections that would start after ``--budget-s`` seconds are skipped and marked so.

What runs, per model size (``--models``; GPU default ``wide,narrow``, CPU ``tiny``):

1. The pipeline: token + positional embedding, ``blocks_per_stage`` pre-norm transformer
   blocks per stage (causal ``scaled_dot_product_attention``, a 4x GELU MLP), final norm
   and LM head on the last stage, cross-entropy; pp=4 stages on the one device, GPipe,
   8 micro-batches, every block wrapped with ``swap_wrapper`` (``--select all``, the
   default, is ppswap's own selection: saved tensors the engine cannot move stay put;
   ``--select device`` adds a ``policy_fn`` selecting only tensors on the device). One
   warm-up step, then
   ``--steps`` measured steps without swap, then the same with swap (``swap=True``, the
   default gap plan), both with one persistent copy engine (``CudaCopyEngine`` on CUDA,
   ``EmulatedDevice`` on CPU), then one more swap step with copy-stream timing events
   (below). Step time: wall clock from a device synchronize before the run to one after
   it, median of the measured steps. Peak device memory: ``torch.cuda.max_memory_allocated``
   over the last measured step (peak statistics reset at its start).
2. The plan's prediction (``simulate.memory_table`` and, for one device, the per-column
   residency ``simulate.resident_by_column``) in bytes: per rank, a chunk's bytes are
   the no-swap ledger peak (``RankStats.peak_saved_bytes``) over the planned no-swap peak
   chunks, its movable bytes the swap run's ``offloaded_bytes`` over its eligible chunks
   (what is not movable, such as a stage input, stays for every live chunk, as in
   ``ppswap/demo/run.py``'s report). All ranks share the device, so the plan's peak is the
   largest per-column sum over ranks; the prediction is the measured no-swap peak minus
   the planned no-swap activation bytes plus the planned swap activation bytes.
3. The hidden share of the copies, two ways. From CUDA events on the copy stream: a
   subclass of ``CudaCopyEngine`` (``TimedCudaCopyEngine``, here, not a change to the
   engine) records an event after the copy stream's wait for the forward and one after
   each copy, its copy threads enqueueing one copy at a time, in a separate instrumented
   step (so the timed steps run the engine as shipped). That gives the copy stream's
   busy time and the D2H / H2D bandwidth; the hidden share is
   ``1 - max(0, swap step - no-swap step) / copy time``. From the runtime:
   ``1 - sum(exposed_copy_wait_s) / sum(copy_busy_s)`` over ranks; on a GPU both are host
   clocks (``copy_busy_s`` includes the copy thread's wait for the forward to finish on
   the device, and compute waiting on the host is not the device idling), so the event
   figure is the one the targets quote. On CPU there are no events: copy time is
   ``copy_busy_s``.
4. The same modules chained unsplit on the whole batch (``8 x micro_batch`` sequences, one
   forward and backward) without offload and under ``save_on_cpu(pin_memory=True)``:
   peak device memory and step time.

Targets (reported, never asserted): peak device memory with swap within ``--tolerance``
(default 10%) of the predicted cut; swap step time at most 1.05x no swap; swap faster than
``save_on_cpu`` at no more peak memory than it. On CPU (``--cpu``, or no CUDA) memory is
ppswap's own ledger (sum over ranks of ``peak_saved_bytes``, the plan summed per rank
too) and the unsplit runs have no memory figure (those parts SKIP).

Sizing (fp32 parameters and activations, IEEE fp32 matmuls:
``torch.set_float32_matmul_precision("highest")``, torch's default):

- Saved per token per block ~17 d floats: the block input, both norms' outputs, qkv (3d),
  the attention output and its contiguous copy, the residual sum, the MLP's 4d input of
  GELU and 4d output: 68 d bytes. A chunk (one stage, one micro-batch) is 2 blocks.
- Whether swap can hide at all is a roofline: a chunk's forward must outlast its offload
  and its backward its load (one copy stream). Per token per block the forward is about
  24 d^2 + 2 s d FLOP, the copy 68 d bytes each way. At H100 / H200 rates (one GH100
  chip: fp32 SIMT ~50 TFLOPS achieved of 67 peak; pinned PCIe Gen5 ~50 GB/s each way) the
  forward covers its offload once 24 d + 2 s > 68 d * 1000, roughly d > 2500 at s = 2048.
- ``wide`` (the primary): d 4096, 32 heads (head dim 128), seq 2048, 1 sequence per
  micro-batch, vocab 8192. Forward per token-block ~420 MFLOP = 8.4 us against an offload
  of 272 KiB = 5.6 us (1.5x margin; the backward 3x). A chunk is ~1.06 GiB; GPipe holds all
  32 chunks at its peak without swap (~34 GiB) beside ~13 GB of parameters and gradients
  (8 x 12 d^2 x 4 B each) and the last stage's log-probs (0.5 GiB): ~47 GiB, activations
  about 3/4 of it. The plan keeps at most 12 of the 32 chunks resident with swap (every
  chunk eligible): ~27 GiB, a cut of ~20 GiB. ~170 TFLOP per step: ~3.5 s; about 17 steps
  in all plus copies and pinned allocation: ~1.5 min.
- ``narrow`` (a control, the brief's first guess): d 1024, 8 heads, seq 2048, 4 sequences
  per micro-batch: the same ~34 GiB of activations (~37 GiB peak without swap, ~16 GiB
  planned with swap) at 1/16 of the compute per token but 1/4 of the bytes: the forward
  (0.6 us per token-block) is ~2.5x shorter than its offload (1.4 us), so the copies
  cannot hide there and the step-time target is expected to FAIL; it shows the memory cut
  and the cost of exposed copies. ~1 s per step without swap: ~0.5 min.
- bfloat16 or TF32 cut the bytes 2x but the compute time 4-15x: copy-bound at these
  widths, hence fp32 by default (``--dtype bfloat16`` is there, on CPU too; a bfloat16
  tensor's host array is ``ml_dtypes``' bfloat16, which the GPU machine's image has).
  ``--autocast`` keeps fp32 weights and runs every pipeline step and unsplit step under
  ``torch.autocast`` to bfloat16 (mixed precision, as most training runs: the run reads
  the caller's autocast and its forwards run under it, ``ppswap/backends/torch/caller.py``).
- Host memory: swap keeps up to 20 chunks on the host (~21 GiB pinned, the pool is
  cleared before the unsplit runs) and ``save_on_cpu`` every saved tensor (~36 GiB pinned;
  torch's pinned cache reuses the same power-of-two blocks): well inside 128 GiB.
- ``tiny`` (CPU): d 32, 2 heads, seq 16, 2 sequences per micro-batch: a few seconds.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final, TypeVar

import anyio
import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
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
from ppswap.swap import swap_wrapper

__all__ = [
    "PRESETS",
    "Block",
    "ModelSize",
    "StageModule",
    "TimedCudaCopyEngine",
    "evaluate_targets",
    "main",
    "plan_prediction",
    "render_markdown",
]

T = TypeVar("T")
Tokens = npt.NDArray[np.int64]
Json = dict[str, Any]

GIB = 2**30
STEP_TIME_TARGET = 1.05
SCHEDULE: Final = "gpipe"
STEP_TIMEOUT_S = 120.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# -- the model -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """A GPT-like model and its pipeline: ``pp`` stages of ``blocks_per_stage`` blocks,
    ``micro`` micro-batches of ``micro_batch`` sequences of ``seq`` tokens."""

    name: str
    dim: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    blocks_per_stage: int = 2
    pp: int = 4
    micro: int = 8

    def __post_init__(self) -> None:
        for name in ("dim", "heads", "seq", "vocab", "micro_batch", "blocks_per_stage"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.pp < 2 or self.micro < 1:
            raise ValueError(f"pp must be >= 2 and micro >= 1, got pp={self.pp} micro={self.micro}")
        if self.dim % self.heads:
            raise ValueError(
                f"dim must be divisible by heads, got dim={self.dim} heads={self.heads}"
            )

    @property
    def batch(self) -> int:
        """Sequences per step (all micro-batches): the unsplit model's batch."""
        return self.micro * self.micro_batch

    @property
    def blocks(self) -> int:
        return self.pp * self.blocks_per_stage

    def flops_per_step(self) -> float:
        """Forward + backward FLOP of one step (3x the forward): matmuls of the blocks and
        the head, causal attention at half the square."""
        d, s = self.dim, self.seq
        per_token_block = 24 * d * d + 2 * s * d
        per_token_head = 2 * d * self.vocab
        tokens = self.batch * s
        return 3.0 * tokens * (self.blocks * per_token_block + per_token_head)

    def describe(self) -> str:
        return (
            f"{self.name}: dim {self.dim}, {self.heads} heads, seq {self.seq}, vocab "
            f"{self.vocab}, {self.blocks_per_stage} blocks/stage, pp {self.pp}, {self.micro} "
            f"micro-batches of {self.micro_batch} (batch {self.batch}), GPipe"
        )


PRESETS: dict[str, ModelSize] = {
    "wide": ModelSize("wide", dim=4096, heads=32, seq=2048, vocab=8192, micro_batch=1),
    "narrow": ModelSize("narrow", dim=1024, heads=8, seq=2048, vocab=8192, micro_batch=4),
    "tiny": ModelSize("tiny", dim=32, heads=2, seq=16, vocab=64, micro_batch=2),
}
"""The model sizes ``--models`` chooses from (module docstring: why these)."""


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a 4x GELU MLP, residuals."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out


@dataclass(frozen=True)
class OnDevice:
    """``swap_wrapper``'s ``policy_fn`` for ``--select device``: a saved tensor is selected
    for swap only when it lives on ``device`` (ppswap itself leaves a tensor the CUDA
    engine cannot move, such as the 0-d CPU philox seed and offset fused attention saves,
    where it is: this is for comparing the two)."""

    device: torch.device

    def __call__(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device


class StageModule(nn.Module):
    """One pipeline stage: the embedding on the first, ``blocks`` wrapped blocks, the final
    norm and LM head on the last. The swap wrapper is transparent outside a pipeline run,
    so the stages chained are the unsplit model. ``policy``: the wrappers' ``policy_fn``."""

    def __init__(
        self,
        size: ModelSize,
        *,
        first: bool,
        last: bool,
        policy: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(size.vocab, size.dim) if first else None
        self.positions = nn.Embedding(size.seq, size.dim) if first else None
        self.blocks = nn.ModuleList(
            swap_wrapper(Block(size.dim, size.heads), policy_fn=policy)
            for _ in range(size.blocks_per_stage)
        )
        self.norm = nn.LayerNorm(size.dim) if last else None
        self.head = nn.Linear(size.dim, size.vocab, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tokens is not None and self.positions is not None:
            where = torch.arange(x.shape[1], device=x.device)
            x = self.tokens(x) + self.positions(where)
        for block in self.blocks:
            x = block(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass(frozen=True)
class Settings:
    """How every model runs: device, dtype, measured steps, which saved tensors swap may
    select (``"device"``: those on the device, ``"all"``: ppswap's default), the memory
    target's tolerance, and whether every step runs under autocast to bfloat16."""

    device: torch.device
    dtype: torch.dtype = torch.float32
    steps: int = 3
    select: str = "all"
    tolerance: float = 0.10
    autocast: bool = False

    def policy(self) -> Callable[[torch.Tensor], bool] | None:
        return OnDevice(self.device) if self.select == "device" else None

    def mixed(self) -> contextlib.AbstractContextManager[Any]:
        """Where each step runs: under ``torch.autocast`` to bfloat16 (``--autocast``)."""
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def build_modules(size: ModelSize, settings: Settings) -> list[nn.Module]:
    """The stage modules, seeded, made directly on the device."""
    torch.manual_seed(0)
    with settings.device:
        modules = [
            StageModule(size, first=index == 0, last=index == size.pp - 1, policy=settings.policy())
            for index in range(size.pp)
        ]
    return [module.to(settings.dtype) for module in modules]


def make_batch(size: ModelSize) -> tuple[Tokens, Tokens]:
    """Random token ids and next-token targets for one step (host arrays)."""
    rng = np.random.default_rng(0)
    shape = (size.batch, size.seq)
    tokens: Tokens = rng.integers(0, size.vocab, shape, dtype=np.int64)
    targets: Tokens = rng.integers(0, size.vocab, shape, dtype=np.int64)
    return tokens, targets


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
    """``CudaCopyEngine`` whose copies record CUDA events on the copy stream.

    Each copy is enqueued under a lock (the ranks' copy threads share the one stream), with
    a start event after the stream's wait for the forward's ``ready`` event and an end
    event after the copy, so a span is the copy, not the wait for compute (the end event
    is recorded once the engine's own wait for the copy returns: a span also holds one
    host round trip, tens of microseconds against copies of milliseconds). ``spans()``
    needs the device synchronized. Used only for the instrumented step: the lock makes the
    copy threads take turns, which the engine as shipped does not.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self._lock = threading.Lock()
        self._spans: list[CopySpan] = []

    def d2h_many(
        self, sources: Sequence[CudaSource], into: Sequence[HostArray | None] | None = None
    ) -> list[HostArray]:
        start, end = _timing_event(), _timing_event()
        with self._lock:
            for ready in {id(source.ready): source.ready for source in sources}.values():
                self.stream.wait_event(ready)
            start.record(self.stream)
            hosts = super().d2h_many(sources, into)
            end.record(self.stream)
            self._spans.append(CopySpan("d2h", sum(s.nbytes for s in sources), start, end))
        return hosts

    def h2d_block(
        self, hosts: Sequence[HostArray], offsets: Sequence[int], nbytes: int
    ) -> list[torch.Tensor]:
        start, end = _timing_event(), _timing_event()
        with self._lock:
            start.record(self.stream)
            loaded = super().h2d_block(hosts, offsets, nbytes)
            end.record(self.stream)
            self._spans.append(CopySpan("h2d", sum(int(h.nbytes) for h in hosts), start, end))
        return loaded

    def h2d(
        self, host: HostArray, strides: tuple[int, ...] | None = None, dtype: str | None = None
    ) -> torch.Tensor:
        start, end = _timing_event(), _timing_event()
        with self._lock:
            start.record(self.stream)
            fresh = super().h2d(host, strides, dtype)
            end.record(self.stream)
            self._spans.append(CopySpan("h2d", int(host.nbytes), start, end))
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


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


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
    pool = getattr(engine, "pool", None)
    if pool is not None:
        pool.clear()


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


# -- the plan ------------------------------------------------------------------------------


def plan_prediction(
    size: ModelSize,
    no_swap: Sequence[Json],
    swap: Sequence[Json],
    measured_no_swap: float,
    *,
    one_device: bool,
) -> Json:
    """The plan's peak with swap in bytes (module docstring, item 2).

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


# -- targets -------------------------------------------------------------------------------


def _target(name: str, status: str, detail: str) -> Json:
    return {"name": name, "status": status, "detail": detail}


def evaluate_targets(figures: Json, tolerance: float) -> list[Json]:
    """PASS / FAIL / SKIP per target from one model's figures (``measure_model``'s)."""
    memory = figures.get("memory", {})
    off, on, predicted = (
        memory.get("peak_no_swap"),
        memory.get("peak_swap"),
        memory.get("predicted_peak_swap"),
    )
    out: list[Json] = []
    if off is None or on is None or predicted is None:
        out.append(_target("memory cut as planned", "SKIP", "no memory figures"))
    else:
        predicted_cut = off - predicted
        miss = abs(on - predicted)
        ok = predicted_cut > 0 and miss <= tolerance * predicted_cut
        out.append(
            _target(
                "memory cut as planned",
                "PASS" if ok else "FAIL",
                f"peak {gib(off)} -> {gib(on)} with swap, planned {gib(predicted)} "
                f"(cut {pct(off - on, off)} measured, {pct(predicted_cut, off)} planned; "
                f"tolerance {tolerance:.0%} of the planned cut = {gib(tolerance * predicted_cut)})",
            )
        )
    timing = figures.get("timing", {})
    t_off, t_on = timing.get("no_swap_s"), timing.get("swap_s")
    if t_off is None or t_on is None:
        out.append(_target(f"step time <= {STEP_TIME_TARGET}x", "SKIP", "no step times"))
    else:
        ratio = t_on / t_off
        out.append(
            _target(
                f"step time <= {STEP_TIME_TARGET}x",
                "PASS" if ratio <= STEP_TIME_TARGET else "FAIL",
                f"swap {t_on:.3f} s / no swap {t_off:.3f} s = {ratio:.3f}x",
            )
        )
    t_save = timing.get("save_on_cpu_s")
    m_save = memory.get("peak_save_on_cpu")
    if t_on is None or t_save is None:
        out.append(_target("faster than save_on_cpu at no more memory", "SKIP", "no step times"))
    else:
        faster = t_on < t_save
        detail = f"swap {t_on:.3f} s vs save_on_cpu {t_save:.3f} s"
        if on is None or m_save is None:
            status = "SKIP" if faster else "FAIL"
            detail += "; no device memory figures to compare"
        else:
            status = "PASS" if faster and on <= m_save else "FAIL"
            detail += f"; peak {gib(on)} vs {gib(m_save)}"
        out.append(_target("faster than save_on_cpu at no more memory", status, detail))
    return out


# -- one model -----------------------------------------------------------------------------


def _section(
    entry: Json, name: str, clock: Clock, write: Callable[[], None], fn: Callable[[], None]
) -> bool:
    """Run one section of a model, recording an error or a skip in ``entry``; whether it
    ran to its end. The report is written after it either way."""
    if clock.exhausted():
        entry["skipped"].append(f"{name}: time budget of {clock.budget_s:.0f} s spent")
        write()
        return False
    started = time.perf_counter()
    print(f"[{clock.elapsed():7.1f}s] {entry['name']}: {name} ...", file=sys.stderr, flush=True)
    try:
        fn()
    except Exception as exc:  # a figure, not a crash: the rest of the check still runs
        entry["errors"].append(
            {
                "section": name,
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-4000:],
            }
        )
        print(f"  {name} failed: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return False
    finally:
        entry["section_s"][name] = round(time.perf_counter() - started, 3)
        write()
    return True


def measure_model(
    size: ModelSize, settings: Settings, clock: Clock, entry: Json, write: Callable[[], None]
) -> None:
    """Every section for one model size, filling ``entry`` (see the module docstring)."""
    device, steps = settings.device, settings.steps
    one_device = device.type == "cuda"
    state: dict[str, Any] = {}

    def build() -> None:
        state["pipeline"] = Pipeline(size, settings)
        entry["parameters"] = sum(
            p.numel() for m in state["pipeline"].modules for p in m.parameters()
        )
        entry["memory"]["parameters_bytes"] = sum(
            p.numel() * p.element_size() for m in state["pipeline"].modules for p in m.parameters()
        )

    def no_swap() -> None:
        engine = make_engine(device)
        figures, _ = state["pipeline"].measure(swap=False, engine=engine, steps=steps)
        entry["pipeline"]["no_swap"] = figures
        entry["memory"]["peak_no_swap"] = figures["peak_bytes"]
        entry["timing"]["no_swap_s"] = figures["median_step_s"]

    def swap() -> None:
        engine = make_engine(device)
        try:
            figures, _ = state["pipeline"].measure(swap=True, engine=engine, steps=steps)
        finally:
            clear_engine(engine)
        entry["pipeline"]["swap"] = figures
        entry["memory"]["peak_swap"] = figures["peak_bytes"]
        entry["timing"]["swap_s"] = figures["median_step_s"]
        base = entry["pipeline"].get("no_swap")
        if base is not None:
            entry["pipeline"]["losses_identical"] = base["losses"] == figures["losses"]
            entry["pipeline"]["grad_norm_max_rel_diff"] = max_rel_diff(
                base["grad_norms"], figures["grad_norms"]
            )

    def copies() -> None:
        engine = make_engine(device, timed_copies=True)
        pipeline: Pipeline = state["pipeline"]
        try:
            result, seconds, peak = timed(partial(pipeline.run, swap=True, engine=engine), device)
        finally:
            clear_engine(engine)
        busy = sum(r.copy_busy_s for r in result.ranks)
        exposed = sum(r.exposed_copy_wait_s for r in result.ranks)
        moved = sum(r.offloaded_bytes + r.loaded_bytes for r in result.ranks)
        out: Json = {
            "instrumented_step_s": seconds,
            "instrumented_peak_bytes": peak,
            "offloaded_bytes": sum(r.offloaded_bytes for r in result.ranks),
            "loaded_bytes": sum(r.loaded_bytes for r in result.ranks),
            "copy_busy_s": busy,
            "exposed_copy_wait_s": exposed,
            "hidden_share_runtime": 1 - exposed / busy if busy > 0 else None,
            "copy_time_source": "runtime copy_busy_s (no CUDA events on CPU)",
            "copy_s": busy,
            "d2h_s": None,
            "h2d_s": None,
            "d2h_gbps": None,
            "h2d_gbps": None,
            "copy_jobs_timed": 0,
        }
        if isinstance(engine, TimedCudaCopyEngine):
            spans = engine.spans()
            d2h = [(n, s) for kind, n, s in spans if kind == "d2h"]
            h2d = [(n, s) for kind, n, s in spans if kind == "h2d"]
            d2h_s, h2d_s = sum(s for _, s in d2h), sum(s for _, s in h2d)
            out.update(
                copy_time_source="CUDA events on the copy stream",
                copy_s=d2h_s + h2d_s,
                d2h_s=d2h_s,
                h2d_s=h2d_s,
                d2h_gbps=sum(n for n, _ in d2h) / d2h_s / 1e9 if d2h_s > 0 else None,
                h2d_gbps=sum(n for n, _ in h2d) / h2d_s / 1e9 if h2d_s > 0 else None,
                copy_jobs_timed=len(spans),
            )
        t_off, t_on = entry["timing"].get("no_swap_s"), entry["timing"].get("swap_s")
        copy_s = out["copy_s"]
        if t_off is not None and t_on is not None and copy_s and copy_s > 0:
            exposed_step = min(max(t_on - t_off, 0.0), copy_s)
            out["exposed_by_step_time_s"] = exposed_step
            out["hidden_share"] = 1 - exposed_step / copy_s
        else:
            out["exposed_by_step_time_s"] = None
            out["hidden_share"] = None
        out["bytes_moved"] = moved
        entry["copies"] = out

    def plan() -> None:
        off, on = entry["pipeline"]["no_swap"], entry["pipeline"]["swap"]
        if one_device:
            measured_off, measured_on = off["peak_bytes"], on["peak_bytes"]
        else:
            measured_off = sum(r["peak_saved_bytes"] for r in off["ranks"])
            measured_on = sum(r["peak_saved_bytes"] for r in on["ranks"])
            entry["memory"]["peak_no_swap"] = measured_off
            entry["memory"]["peak_swap"] = measured_on
        prediction = plan_prediction(
            size, off["ranks"], on["ranks"], measured_off, one_device=one_device
        )
        entry["plan"] = prediction
        entry["memory"]["source"] = (
            "torch.cuda.max_memory_allocated"
            if one_device
            else "ppswap ledger: sum over ranks of RankStats.peak_saved_bytes"
        )
        entry["memory"]["predicted_peak_swap"] = prediction["predicted_peak_swap"]
        entry["memory"]["peak_swap"] = measured_on

    def release_pipeline() -> None:
        state["pipeline"].drop_stages()
        _release(device)

    def unsplit() -> None:
        figures = measure_unsplit(state["pipeline"], offload=False, steps=steps)
        entry["unsplit"]["no_offload"] = figures
        entry["memory"]["peak_unsplit"] = figures["peak_bytes"]
        entry["timing"]["unsplit_s"] = figures["median_step_s"]
        _release(device)

    def save_on_cpu() -> None:
        figures = measure_unsplit(state["pipeline"], offload=True, steps=steps)
        entry["unsplit"]["save_on_cpu"] = figures
        entry["memory"]["peak_save_on_cpu"] = figures["peak_bytes"]
        entry["timing"]["save_on_cpu_s"] = figures["median_step_s"]
        _release(device)

    try:
        if not _section(entry, "build", clock, write, build):
            return
        ran_off = _section(entry, "pipeline without swap", clock, write, no_swap)
        ran_on = _section(entry, "pipeline with swap", clock, write, swap)
        if ran_on:
            _section(entry, "copies (instrumented swap step)", clock, write, copies)
        if ran_off and ran_on:
            _section(entry, "plan", clock, write, plan)
        _section(entry, "release the pipeline", clock, write, release_pipeline)
        _section(entry, "unsplit without offload", clock, write, unsplit)
        _section(entry, "unsplit under save_on_cpu", clock, write, save_on_cpu)
    finally:
        state.clear()
        _release(device)
        t_off, t_on = entry["timing"].get("no_swap_s"), entry["timing"].get("swap_s")
        entry["timing"]["ratio_swap"] = t_on / t_off if t_off and t_on else None
        flops = size.flops_per_step()
        entry["timing"]["flops_per_step"] = flops
        entry["timing"]["achieved_tflops_no_swap"] = flops / t_off / 1e12 if t_off else None
        entry["targets"] = evaluate_targets(entry, entry["tolerance"])
        write()


def new_entry(size: ModelSize, dtype: str, tolerance: float, autocast: bool = False) -> Json:
    """A model's JSON entry with every key present (None until measured)."""
    return {
        "name": size.name,
        "size": dataclasses.asdict(size),
        "description": size.describe(),
        "dtype": dtype,
        "autocast": "bfloat16" if autocast else None,
        "tolerance": tolerance,
        "parameters": None,
        "pipeline": {
            "no_swap": None,
            "swap": None,
            "losses_identical": None,
            "grad_norm_max_rel_diff": None,
        },
        "unsplit": {"no_offload": None, "save_on_cpu": None},
        "memory": {
            "source": None,
            "parameters_bytes": None,
            "peak_no_swap": None,
            "peak_swap": None,
            "predicted_peak_swap": None,
            "peak_unsplit": None,
            "peak_save_on_cpu": None,
        },
        "timing": {
            "no_swap_s": None,
            "swap_s": None,
            "ratio_swap": None,
            "unsplit_s": None,
            "save_on_cpu_s": None,
            "flops_per_step": None,
            "achieved_tflops_no_swap": None,
        },
        "copies": None,
        "plan": None,
        "targets": [],
        "errors": [],
        "skipped": [],
        "section_s": {},
    }


# -- the machine ---------------------------------------------------------------------------


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        found = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).resolve().parent,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return found.stdout.strip() or None


def machine_info(device: torch.device) -> Json:
    """Where the check ran: host, Python, packages, the device."""
    info: Json = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "numpy": np.__version__,
        "anyio": _version("anyio"),
        "structlog": _version("structlog"),
        "ppswap_commit": _git_commit(),
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "device": str(device),
        "device_name": "cpu",
        "device_memory_bytes": None,
        "device_capability": None,
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            device_name=props.name,
            device_memory_bytes=int(props.total_memory),
            device_capability=f"{props.major}.{props.minor}",
        )
    return info


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


# -- the report ----------------------------------------------------------------------------


def gib(nbytes: float | None) -> str:
    """Bytes for people: GiB from a tenth of one, MiB below."""
    if nbytes is None:
        return "-"
    if abs(nbytes) >= GIB / 10:
        return f"{nbytes / GIB:.2f} GiB"
    return f"{nbytes / 2**20:.2f} MiB"


def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole else "-"


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.3f}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render_markdown(report: Json) -> str:
    """The report as markdown: machine, then per model its tables and target lines."""
    machine, rates = report["machine"], report["probe"] or {}
    lines = [
        "# ppswap GPU check",
        "",
        f"- mode: {report['mode']}; device: {machine['device']} ({machine['device_name']}"
        + (f", {gib(machine['device_memory_bytes'])}" if machine["device_memory_bytes"] else "")
        + ")",
        f"- host {machine['host']}, {machine['platform']}, {machine['cpu_count']} CPUs",
        f"- Python {machine['python']}, torch {machine['torch']} (CUDA {machine['torch_cuda']}), "
        f"numpy {machine['numpy']}, anyio {machine['anyio']}, structlog {machine['structlog']}; "
        f"ppswap {machine['ppswap_commit'] or 'commit unknown'}",
        f"- float32 matmul precision: {machine['float32_matmul_precision']}; probe: "
        f"{'pinned ' if rates.get('pinned') else ''}D2H {_num(rates.get('d2h_gbps'))} GB/s, "
        f"H2D {_num(rates.get('h2d_gbps'))} GB/s, fp32 matmul "
        f"{_num(rates.get('matmul_fp32_tflops'), 3)} TFLOPS",
        f"- swap selects saved tensors: {report['select']}; "
        f"{report['steps']} measured steps after a warm-up step, median; "
        f"elapsed {report['elapsed_s']:.1f} s",
    ]
    for entry in report["models"]:
        lines += ["", *_model_markdown(entry)]
    return "\n".join(lines) + "\n"


def _model_markdown(entry: Json) -> list[str]:
    memory, timing = entry["memory"], entry["timing"]
    off = memory.get("peak_no_swap")
    t_off = timing.get("no_swap_s")
    lines = [
        f"## {entry['description']}, {entry['dtype']}"
        + (f" under autocast to {entry['autocast']}" if entry.get("autocast") else ""),
        "",
        f"Memory: {memory.get('source') or '-'}; parameters "
        f"{entry['parameters'] or '-'} ({gib(memory.get('parameters_bytes'))}).",
        "",
        "| configuration | peak memory | vs pipeline no swap | step s (median) "
        "| vs pipeline no swap |",
        "|---|---:|---:|---:|---:|",
    ]
    rows = [
        ("pipeline, no swap", off, t_off),
        ("pipeline, ppswap swap", memory.get("peak_swap"), timing.get("swap_s")),
        ("plan: predicted with swap", memory.get("predicted_peak_swap"), None),
        ("unsplit, no offload", memory.get("peak_unsplit"), timing.get("unsplit_s")),
        (
            "unsplit, save_on_cpu(pin_memory=True)",
            memory.get("peak_save_on_cpu"),
            timing.get("save_on_cpu_s"),
        ),
    ]
    for label, peak, seconds in rows:
        lines.append(
            f"| {label} | {gib(peak)} | "
            f"{_x(peak / off) if peak is not None and off else '-'} | {_s(seconds)} | "
            f"{_x(seconds / t_off) if seconds is not None and t_off else '-'} |"
        )
    copies = entry.get("copies") or {}
    lines += [
        "",
        "| copies | value |",
        "|---|---:|",
        f"| offloaded / loaded | {gib(copies.get('offloaded_bytes'))} / "
        f"{gib(copies.get('loaded_bytes'))} |",
        f"| copy time s ({copies.get('copy_time_source', '-')}) | {_s(copies.get('copy_s'))} |",
        f"| D2H / H2D GB/s (events) | {_num(copies.get('d2h_gbps'))} / "
        f"{_num(copies.get('h2d_gbps'))} |",
        f"| step time added by swap s | {_s(copies.get('exposed_by_step_time_s'))} |",
        f"| copy time hidden (1 - added step time / copy time) | "
        f"{_share(copies.get('hidden_share'))} |",
        f"| runtime: copy busy s / exposed wait s | {_s(copies.get('copy_busy_s'))} / "
        f"{_s(copies.get('exposed_copy_wait_s'))} |",
        f"| runtime: copy time hidden (1 - exposed wait / copy busy) | "
        f"{_share(copies.get('hidden_share_runtime'))} |",
        f"| achieved TFLOPS without swap | {_num(timing.get('achieved_tflops_no_swap'), 3)} |",
        f"| peak reserved no swap / swap (allocator) | "
        f"{gib((entry['pipeline'].get('no_swap') or {}).get('peak_reserved_bytes'))} / "
        f"{gib((entry['pipeline'].get('swap') or {}).get('peak_reserved_bytes'))} |",
        f"| swap losses identical / grad norms max rel diff | "
        f"{entry['pipeline'].get('losses_identical')} / "
        f"{_num(entry['pipeline'].get('grad_norm_max_rel_diff'), 9)} |",
    ]
    plan = entry.get("plan")
    if plan:
        lines += [
            "",
            f"Plan ({_plan_scope(plan['one_device'])}): "
            f"peak chunks {plan['peak_chunks_no_swap']} -> {plan['peak_chunks_swap']}, "
            f"planned activation bytes {gib(plan['planned_saved_no_swap'])} -> "
            f"{gib(plan['planned_saved_swap'])}.",
            "",
            "| rank | chunks no swap -> swap (plan) | eligible | chunk MiB | movable MiB "
            "| saved peak no swap MiB | with swap MiB | predicted with swap MiB |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in plan["ranks"]:
            lines.append(
                f"| {row['rank']} | {row['chunks_no_swap']} -> {row['chunks_swap']} | "
                f"{row['eligible']} | {_mib(row['chunk_bytes'])} | "
                f"{_mib(row['movable_chunk_bytes'])} | {_mib(row['measured_saved_no_swap'])} | "
                f"{_mib(row['measured_saved_swap'])} | {_mib(row['predicted_saved_swap'])} |"
            )
    lines += ["", "Targets:", ""]
    lines += [f"- {t['status']} {t['name']}: {t['detail']}" for t in entry["targets"]]
    for error in entry["errors"]:
        lines.append(f"- ERROR in {error['section']}: {error['error']}")
    for skipped in entry["skipped"]:
        lines.append(f"- skipped {skipped}")
    return lines


def _plan_scope(one_device: bool) -> str:
    return "all ranks on one device: largest per-column sum" if one_device else "per rank, summed"


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f}"


# -- main ----------------------------------------------------------------------------------


def _sizes(names: str, overrides: Sequence[str]) -> list[ModelSize]:
    sizes = []
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name not in PRESETS:
            raise SystemExit(f"--models: unknown size {name!r} (known: {', '.join(PRESETS)})")
        sizes.append(PRESETS[name])
    changes: dict[str, Any] = {}
    known = {f.name for f in dataclasses.fields(ModelSize)} - {"name"}
    for item in overrides:
        key, _, value = item.partition("=")
        if key not in known or not value.lstrip("-").isdigit():
            raise SystemExit(f"--set: expected KEY=INT with KEY in {sorted(known)}, got {item!r}")
        changes[key] = int(value)
    try:
        return [dataclasses.replace(size, **changes) for size in sizes]
    except ValueError as exc:
        raise SystemExit(f"--set: {exc}") from exc


def _write_json(path: Path, report: Json) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial_path = path.with_name(path.name + ".partial")
    partial_path.write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    partial_path.replace(path)


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run on CPU (also when no CUDA)")
    parser.add_argument("--out", type=Path, default=Path("out/gpu_check"), help="output dir")
    parser.add_argument("--json", type=Path, default=None, help="default <out>/gpu_check.json")
    parser.add_argument("--models", default=None, help="sizes, comma-separated (GPU: wide,narrow)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=INT",
        help="override a size field for every model (dim=2048)",
    )
    parser.add_argument("--steps", type=int, default=3, help="measured steps after a warm-up")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument(
        "--autocast",
        action="store_true",
        help="float32 weights, every step under torch.autocast to bfloat16",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=0.10,
        help="memory target: share of the planned cut the peak may miss by",
    )
    parser.add_argument(
        "--select",
        choices=("device", "all"),
        default="all",
        help="saved tensors swap may select: those on the device (default) or all (ppswap's "
        "default, which hands CPU tensors saved in a CUDA stage to the CUDA engine)",
    )
    parser.add_argument(
        "--budget-s", type=float, default=240.0, help="start no section after this many seconds"
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    sizes = _sizes(args.models or ("wide,narrow" if cuda else "tiny"), args.set)
    if not cuda:
        # A code-path check, not a benchmark: one intra-op thread keeps the compute, copy
        # and event-loop threads from fighting torch's thread pool on a small machine.
        torch.set_num_threads(1)
    if args.autocast and args.dtype != "float32":
        parser.error(f"--autocast needs --dtype float32 (the weights), got {args.dtype}")
    settings = Settings(
        device, _DTYPES[args.dtype], args.steps, args.select, args.tolerance, args.autocast
    )
    json_path = args.json or args.out / "gpu_check.json"
    md_path = args.out / "gpu_check.md"
    clock = Clock(args.budget_s)
    with _matmul_precision("highest"):
        report: Json = {
            "mode": "cuda" if cuda else "cpu",
            "machine": machine_info(device),
            "probe": None,
            "steps": args.steps,
            "select": args.select,
            "elapsed_s": 0.0,
            "models": [],
        }

        def write() -> None:
            report["elapsed_s"] = clock.elapsed()
            _write_json(json_path, report)

        try:
            report["probe"] = probe(device)
        except Exception as exc:  # the check goes on without the rates
            report["probe"] = {"error": f"{type(exc).__name__}: {exc}"}
        write()
        for size in sizes:
            entry = new_entry(size, args.dtype, args.tolerance, args.autocast)
            report["models"].append(entry)
            measure_model(size, settings, clock, entry, write)
    write()
    markdown = render_markdown(report)
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown, encoding="utf-8")
    print(markdown)
    for entry in report["models"]:
        for target in entry["targets"]:
            print(f"{target['status']} [{entry['name']}] {target['name']}: {target['detail']}")
    print(f"wrote {json_path} and {md_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
