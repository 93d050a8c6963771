"""Soak: ppswap's RSS growth over many runs beside a plain MindSpore loop, in one process.

    python benchmarks/bench_soak.py [--runs 192] [--block 40] [--settle 8] [--plot PATH]
                                    [--json PATH]

The question: does the process grow because of ppswap, or because of the framework under
it? Three series of runs share one process, one model and one batch:

- ``swap on``: ``run_schedule`` (1F1B, pp4, 8 micro-batches, ``swap=True``), cycling
  *ok, failed, ok, cancelled*: the failure is a ``fail_compute`` at the BWD of the last
  micro-batch on the last rank, the cancellation a ``call_at`` that cancels the run's
  scope at the BWD of the last micro-batch on rank 1, so the teardown drops many chunks,
  offloaded ones among them;
- ``swap off``: the same runs with ``swap=False``;
- ``baseline``: per run, one ``mindspore.value_and_grad`` call (gradients of the inputs and
  the weights, as a stage's backward computes) per micro-batch over the *unsplit* model,
  ``build_lm_unsplit`` chained from the very stage modules, on the same micro-batches.

``--runs`` counts pipeline runs (settling runs included), half of them with swap; the
baseline runs as many times as each pipeline series. Output: a markdown table per series
(runs, outcomes, growth, least-squares slope in KB per run, median block rate, median
growth per kind of run) and, for each pipeline series, its difference from the baseline:
what ppswap adds. ``--plot`` draws the curves (needs matplotlib), ``--json`` writes every
per-run sample.

How the comparison is made fair:

- Attribution: the RSS (``/proc/self/statm``, after ``gc.collect()``) is sampled between
  every two runs; a run's growth is the difference of the samples around it, and a
  series' curve is the running sum of its own measured runs' growths (its slope: least
  squares over its run index).
- Interleaving: the runs go in rounds of one block per series; the order within a round
  walks through the six permutations of the three series, so every series runs first,
  second and third, and after each other series, equally often; machine load and any
  slow drift fall on the three alike. A block is whole cycles of run kinds.
- Settling: the RSS is a high-water mark (MindSpore's CPU memory pool keeps what it
  freed), so at the start of a block the growth is not the block's own: a series whose
  runs need more memory at their peak than the previous series' pays, in its first run,
  for growth the previous series left inside memory freed earlier, and a series with a
  smaller peak grows into such memory without raising the RSS. The first ``--settle`` runs
  of every block absorb that hand-over; they are reported apart and left out of the
  rates (measured over 576 runs: the settling runs of a pipeline block grew 45-57 KB per
  run more than its other runs, those of a baseline block 35 KB less).
- Warm-up: before the first round, one block of each series runs unmeasured (kernel and
  oneDNN primitive caches, MindSpore's memory pool, ppswap's host-buffer pool).
- Threads: ppswap computes on a compute thread started for each run; every baseline run
  runs on a thread started for it too, so both allocate from the same glibc arenas.
- Work: MindSpore's steady growth here is per MatMul launch (the probe below measures it:
  about 1.4 KB per launch on mindspore 2.10 CPU, whether a graph is recorded or not), so
  both sides must launch the same kernels. A pipeline run launches per micro-batch and
  stage one forward and one backward: what a training step of the unsplit model launches
  per micro-batch. The failure and the cancellation come after every forward has run, and
  the teardown runs each abandoned chunk's backward with a zero sensitivity, so failed and
  cancelled runs launch (nearly) what successful ones do.
- Statistics: the slope uses every measured run; the median of the per-round differences
  (a pipeline block's rate minus the same round's baseline block's) ignores rounds in
  which a one-off heap step landed in one of the two blocks.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio
import mindspore as ms
import numpy as np
import numpy.typing as npt
from mindspore import Tensor, nn, ops

from ppswap import EmulatedDevice, PipelineError, PipelineStage, StepKind, run_schedule
from ppswap.core.faults import FaultPlan, call_at, fail_compute
from ppswap.demo.model import build_lm_unsplit, build_mlp_stages, mse_loss
from ppswap.swap import swap_wrapper

try:  # the plot needs the optional 'plot' extra (matplotlib)
    from matplotlib.figure import Figure
except ImportError:  # pragma: no cover - depends on the environment
    Figure = None  # type: ignore[misc,assignment]

HostArray = npt.NDArray[Any]

SCHEDULE = "1f1b"
PP = 4
MICRO = 8
DIM = 64
MICRO_BATCH = 32
KIB = 1024
MIB = 2**20
PAGE = os.sysconf("SC_PAGE_SIZE")

SWAP_ON, SWAP_OFF, BASELINE = "swap on", "swap off", "baseline"
SERIES = (SWAP_ON, SWAP_OFF, BASELINE)
ORDERS = tuple(itertools.permutations(SERIES))
KINDS = ("ok", "fail", "ok", "cancel")  # one cycle; blocks and settling are whole cycles


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc/self/statm``)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * PAGE


def sample_rss() -> int:
    """RSS after a full collection: what the runs left, not what is waiting for the GC."""
    gc.collect()
    return rss_bytes()


@dataclass(frozen=True)
class Sample:
    """One run of the soak: its series, kind and outcome, and the RSS around it."""

    round: int
    series: str
    index: int  # the run's index within its series
    settling: bool  # one of the first runs of its block: left out of the rates
    kind: str
    outcome: str
    rss_before: int
    rss_after: int
    seconds: float

    @property
    def growth(self) -> int:
        return self.rss_after - self.rss_before


@dataclass(frozen=True)
class SeriesStats:
    """One series' growth: total, least-squares slope and median block rate (bytes)."""

    series: str
    runs: int
    outcomes: dict[str, int]
    growth: int
    slope: float
    block_rates: tuple[float, ...]  # per round: the block's growth per measured run
    per_outcome: dict[str, float]  # median growth of one run, per outcome
    settling: float  # mean growth of a settling run

    @property
    def median_block_rate(self) -> float:
        return statistics.median(self.block_rates)


class Workload:
    """The model, the batch and the three kinds of run over them."""

    def __init__(self) -> None:
        modules = build_mlp_stages(PP, dim=DIM, blocks_per_stage=1, wrap=swap_wrapper)
        self.stages = [PipelineStage(m, i, PP) for i, m in enumerate(modules)]
        self.device = EmulatedDevice()  # one host pool for every run, as a Schedule keeps
        rng = np.random.default_rng(7)
        self.x: HostArray = rng.standard_normal((MICRO * MICRO_BATCH, DIM)).astype(np.float32)
        self.y: HostArray = np.tanh(self.x)
        # The baseline: the same stage modules (the same Parameter objects) chained.
        self.model: nn.Cell = build_lm_unsplit(modules)
        weights = self.model.trainable_params()
        self.grad_fn = ms.value_and_grad(self._loss, grad_position=0, weights=weights)

    def _loss(self, x: Tensor, y: Tensor) -> Tensor:
        loss: Tensor = mse_loss(self.model(x), y)
        return loss

    def _baseline_steps(self, errors: list[BaseException]) -> None:
        try:
            for x, y in zip(np.split(self.x, MICRO), np.split(self.y, MICRO), strict=True):
                self.grad_fn(Tensor(x), Tensor(y))
        except BaseException as error:  # re-raised on the caller's thread
            errors.append(error)

    def baseline_run(self) -> str:
        """One training step per micro-batch over the unsplit model, on a new thread."""
        errors: list[BaseException] = []
        thread = threading.Thread(target=self._baseline_steps, args=(errors,), name="soak-baseline")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return "ok"

    async def pipeline_run(self, swap: bool, kind: str) -> str:
        """One ``run_schedule`` of ``kind``; its outcome: ok, failed or cancelled."""
        with anyio.CancelScope() as scope:
            faults = None
            if kind == "fail":
                faults = FaultPlan((fail_compute(StepKind.BWD, rank=PP - 1, micro=MICRO - 1),))
            elif kind == "cancel":
                faults = FaultPlan((call_at(scope.cancel, StepKind.BWD, rank=1, micro=MICRO - 1),))
            try:
                await run_schedule(
                    self.stages,
                    SCHEDULE,
                    inputs=self.x,
                    targets=self.y,
                    loss_fn=mse_loss,
                    micro_batch_num=MICRO,
                    pp=PP,
                    swap=swap,
                    faults=faults,
                    device=self.device,
                    step_timeout=300.0,
                )
            except PipelineError:
                return "failed"
        return "cancelled" if scope.cancelled_caught else "ok"

    async def run(self, series: str, kind: str) -> str:
        if series == BASELINE:
            return self.baseline_run()
        return await self.pipeline_run(series == SWAP_ON, kind)


def least_squares_slope(values: Sequence[float]) -> float:
    """Slope of the least-squares line through ``values`` over their index."""
    if len(values) < 2:
        return 0.0
    index = np.arange(len(values), dtype=np.float64)
    return float(np.polyfit(index, np.asarray(values, dtype=np.float64), 1)[0])


def own_curve(samples: Sequence[Sample], series: str) -> list[int]:
    """A series' own growth curve: 0, then the running sum of its measured runs' growths."""
    growths = [s.growth for s in samples if s.series == series and not s.settling]
    return [0, *itertools.accumulate(growths)]


def series_stats(samples: Sequence[Sample], series: str) -> SeriesStats:
    mine = [s for s in samples if s.series == series]
    measured = [s for s in mine if not s.settling]
    rounds = sorted({s.round for s in measured})
    rates = tuple(statistics.fmean(s.growth for s in measured if s.round == r) for r in rounds)
    kinds = sorted({s.outcome for s in measured})
    return SeriesStats(
        series=series,
        runs=len(measured),
        outcomes=dict(Counter(s.outcome for s in measured)),
        growth=sum(s.growth for s in measured),
        slope=least_squares_slope([float(v) for v in own_curve(samples, series)]),
        block_rates=rates,
        per_outcome={
            k: statistics.median(s.growth for s in measured if s.outcome == k) for k in kinds
        },
        settling=statistics.fmean(s.growth for s in mine if s.settling)
        if len(mine) > len(measured)
        else 0.0,
    )


def round_differences(pipeline: SeriesStats, baseline: SeriesStats) -> list[float]:
    """Per round: the pipeline block's growth per run minus the baseline block's."""
    return [p - b for p, b in zip(pipeline.block_rates, baseline.block_rates, strict=True)]


async def soak(
    work: Workload, rounds: int, block: int, settle: int, progress: bool
) -> list[Sample]:
    """Warm up (one block of each series, not returned), then ``rounds`` rounds of one
    block per series; the first ``settle`` runs of every block are marked settling."""
    for series in SERIES:
        for index in range(block):
            await work.run(series, KINDS[index % len(KINDS)])
    counters = dict.fromkeys(SERIES, 0)
    samples: list[Sample] = []
    before = sample_rss()
    for number in range(rounds):
        for series in ORDERS[number % len(ORDERS)]:
            for index in range(block):
                kind = "ok" if series == BASELINE else KINDS[index % len(KINDS)]
                started = time.perf_counter()
                outcome = await work.run(series, kind)
                seconds = time.perf_counter() - started
                after = sample_rss()
                samples.append(
                    Sample(
                        round=number,
                        series=series,
                        index=counters[series],
                        settling=index < settle,
                        kind=kind,
                        outcome=outcome,
                        rss_before=before,
                        rss_after=after,
                        seconds=seconds,
                    )
                )
                counters[series] += 1
                before = after
        if progress:
            print(f"[soak] round {number + 1}/{rounds}: RSS {before / MIB:.1f} MB", file=sys.stderr)
    return samples


def matmul_probe(launches: int) -> float:
    """Bytes of RSS one CPU MatMul launch keeps (32x64 @ 64x64, after a warm-up)."""
    a = ops.ones((MICRO_BATCH, DIM), ms.float32)
    b = ops.ones((DIM, DIM), ms.float32)
    for _ in range(launches):
        ops.matmul(a, b)
    before = sample_rss()
    for _ in range(launches):
        ops.matmul(a, b)
    return (sample_rss() - before) / launches


def _kb(value: float) -> str:
    return f"{value / KIB:+.1f}" if value < 0 else f"{value / KIB:.1f}"


def _outcomes(stats: SeriesStats) -> str:
    return " / ".join(str(stats.outcomes.get(k, 0)) for k in ("ok", "failed", "cancelled"))


def summary_table(stats: dict[str, SeriesStats]) -> str:
    """The markdown table: one row per series, the pipeline rows with their difference."""
    base = stats[BASELINE]
    lines = [
        "| series | measured runs | ok / failed / cancelled | RSS growth MB | slope KB/run "
        "| median block KB/run | median run KB: ok / failed / cancelled "
        "| minus baseline: slope KB/run | minus baseline: median of rounds KB/run "
        "(quartiles) | settling run KB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in SERIES:
        row = stats[name]
        diff_slope = diff_median = "-"
        if name != BASELINE:
            diffs = round_differences(row, base)
            quartiles = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else [diffs[0]] * 3
            diff_slope = f"{(row.slope - base.slope) / KIB:+.1f}"
            diff_median = (
                f"{statistics.median(diffs) / KIB:+.1f} "
                f"({quartiles[0] / KIB:+.1f} .. {quartiles[2] / KIB:+.1f})"
            )
        per_outcome = " / ".join(
            _kb(row.per_outcome[k]) if k in row.per_outcome else "-"
            for k in ("ok", "failed", "cancelled")
        )
        lines.append(
            f"| {name} | {row.runs} | {_outcomes(row)} | {row.growth / MIB:.1f} "
            f"| {_kb(row.slope)} | {_kb(row.median_block_rate)} | {per_outcome} "
            f"| {diff_slope} | {diff_median} | {_kb(row.settling)} |"
        )
    return "\n".join(lines)


def plot(samples: Sequence[Sample], stats: dict[str, SeriesStats], path: Path) -> bool:
    """Draw each series' own growth curve and the process RSS; False without matplotlib."""
    if Figure is None:
        return False
    figure = Figure(figsize=(11.0, 4.2))
    own, process = figure.subplots(1, 2)
    colors = {SWAP_ON: "tab:red", SWAP_OFF: "tab:blue", BASELINE: "tab:gray"}
    for name in SERIES:
        curve = np.asarray(own_curve(samples, name), dtype=np.float64) / MIB
        own.plot(
            curve,
            color=colors[name],
            label=f"{name}: {stats[name].slope / KIB:.1f} KB/run",
        )
        points = [(i, s.rss_after / MIB) for i, s in enumerate(samples) if s.series == name]
        # (settling runs included: this is the process as it went)
        process.scatter(*zip(*points, strict=True), s=3, color=colors[name], label=name)
    own.set_xlabel("measured run of the series (settling runs left out)")
    own.set_ylabel("RSS growth of its own runs, MB")
    own.set_title("Each series' own growth (least-squares slope)")
    own.legend(loc="upper left")
    process.set_xlabel("run of the process (interleaved blocks)")
    process.set_ylabel("process RSS after the run, MB")
    process.set_title("The process")
    process.legend(loc="upper left", markerscale=4)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", type=int, default=288, help="pipeline runs, half with swap (rounded up to rounds)"
    )
    parser.add_argument(
        "--block", type=int, default=24, help="runs per block, settling included (a multiple of 4)"
    )
    parser.add_argument(
        "--settle", type=int, default=8, help="first runs of a block left out (a multiple of 4)"
    )
    parser.add_argument("--probe", type=int, default=4000, help="MatMul launches of the probe")
    parser.add_argument("--plot", type=Path, default=None, help="write the curves (PNG) here")
    parser.add_argument("--json", type=Path, default=None, help="write every sample here")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    cycle = len(KINDS)
    if args.settle < 0 or args.settle % cycle or args.block <= args.settle or args.block % cycle:
        parser.error(
            f"--block and --settle must be multiples of {cycle} with 0 <= settle < block, got "
            f"{args.block} and {args.settle}"
        )
    if args.runs < 2 * args.block:
        parser.error(f"--runs must be at least two blocks ({2 * args.block}), got {args.runs}")
    rounds = math.ceil(args.runs / 2 / args.block)
    started = time.perf_counter()
    work = Workload()
    first = sample_rss()
    samples = anyio.run(soak, work, rounds, args.block, args.settle, not args.quiet)
    per_launch = matmul_probe(args.probe)
    stats = {name: series_stats(samples, name) for name in SERIES}
    per_series = rounds * args.block
    print(
        f"{SCHEDULE.upper()} pp{PP}, {MICRO} micro-batches of {MICRO_BATCH} samples, an MLP "
        f"of {PP} blocks of width {DIM} (one per stage, each wrapped with `swap_wrapper`); "
        f"{2 * per_series} pipeline runs ({per_series} with swap, {per_series} without, "
        f"cycling {', '.join(KINDS)}) and {per_series} baseline runs ({MICRO} "
        f"`value_and_grad` steps of the unsplit model each), in {rounds} round(s) of one "
        f"block of {args.block} runs per series, after a warm-up block of each; the first "
        f"{args.settle} runs of every block settle and are left out of the rates.\n"
    )
    print(summary_table(stats))
    base = stats[BASELINE]
    measured = samples[-1].rss_after - samples[0].rss_before
    print(
        f"\nProcess RSS {first / MIB:.0f} MB after building the model, "
        f"{samples[0].rss_before / MIB:.0f} MB after the warm-up, "
        f"{samples[-1].rss_after / MIB:.0f} MB at the end (+{measured / MIB:.1f} MB over "
        f"{len(samples)} runs)."
    )
    print(
        f"\nMindSpore alone: a CPU MatMul launch ({MICRO_BATCH}x{DIM} @ {DIM}x{DIM}, after "
        f"{args.probe} launches) keeps {per_launch:.0f} bytes (1.1-1.6 KB from process to "
        f"process); the baseline's slope is {base.slope / per_launch:.0f} such launches per "
        f"run (a training step launches 3 MatMuls per Dense layer, forward, dx and dW: "
        f"{3 * 2 * PP * MICRO} per run here)."
    )
    seconds = {
        name: statistics.median(s.seconds for s in samples if s.series == name) for name in SERIES
    }
    print(
        "\nMedian seconds per run: "
        + ", ".join(f"{name} {value:.2f}" for name, value in seconds.items())
        + f" ({time.perf_counter() - started:.0f} s in all)."
    )
    if args.plot is not None:
        drawn = plot(samples, stats, args.plot)
        print(f"\nCurves: `{args.plot}`." if drawn else "\n(no plot: matplotlib is missing)")
    if args.json is not None:
        payload = {
            "stats": {name: asdict(row) for name, row in stats.items()},
            "matmul_bytes_per_launch": per_launch,
            "samples": [asdict(s) for s in samples],
        }
        args.json.write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
