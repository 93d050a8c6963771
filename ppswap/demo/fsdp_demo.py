"""``ppswap demo --fsdp``: the LM demo over a DP x PP mesh, parameter and activation savings.

The LM is ``opts.backend``'s (MindSpore or torch, ``load_demo_model``). Every (stage, dp
replica) holds its own copy of the stage, built from the same seed, its layers wrapped
with ``swap_wrapper`` and the stage then ``fully_shard()``-ed with its dp rank.
The demo trains ``steps`` steps with swap off and with swap on, their steps taken in turn
(same weights, same batches: the losses must agree bit for bit), each step updating the
*shards* with plain SGD on the shard gradients, and reports per world rank:

- parameter bytes, measured from the storages: the unsharded stage (what a pp-only rank
  holds all the time), the shard kept between uses and the peak during a use;
- saved activation bytes at their peak, swap off and on.

``run_fsdp_demo(opts, dp=2)`` returns an ``FsdpDemoReport``; ``format_fsdp_report``
renders the table; ``main_fsdp_demo`` is the CLI entry (exit status 1 when the losses
differ).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from ppswap.core.messages import HostArray
from ppswap.demo.progress import Progress
from ppswap.demo.report import step_time_line
from ppswap.demo.run import (
    DEMO_LM_SIZES,
    SCHEDULE_CLASSES,
    DemoModel,
    DemoOptions,
    LMShape,
    TrainingPass,
    lm_batches,
    load_corpus,
    load_demo_model,
    train_in_turn,
)
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.results import RunResult
from ppswap.stage import PipelineStage
from ppswap.swap import EmulatedDevice, swap_wrapper

__all__ = [
    "FsdpDemoReport",
    "StageSplitter",
    "format_fsdp_report",
    "main_fsdp_demo",
    "run_fsdp_demo",
    "train_replicas",
]


@dataclass(frozen=True, slots=True)
class FsdpDemoReport:
    """Both passes of the FSDP demo: losses per step and the last step's results."""

    dp: int
    pp: int
    losses_no_swap: list[float]
    losses_swap: list[float]
    last_no_swap: RunResult
    last_swap: RunResult
    step_times_no_swap: list[float]
    step_times_swap: list[float]


def _sharded_lm(
    model: DemoModel, cfg: LMShape, stage_num: int, mesh: DeviceMesh
) -> list[PipelineStage]:
    stages: list[PipelineStage] = []
    for dp_rank in range(mesh.dp):
        for index, module in enumerate(model.build_stages(cfg, stage_num)):
            for layer_index, layer in enumerate(module.layers):
                module.layers[layer_index] = swap_wrapper(layer)
            fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            stages.append(PipelineStage(module, index, stage_num))
    return stages


StageSplitter = Callable[[DemoModel, LMShape, int, DeviceMesh], list[PipelineStage]]
"""Builds every (stage, dp replica) of the LM over a mesh: ``(model, cfg, stage_num,
mesh)``."""


def train_replicas(
    opts: DemoOptions,
    model: DemoModel,
    cfg: LMShape,
    mesh: DeviceMesh,
    data: list[tuple[HostArray, HostArray]],
    *,
    split: StageSplitter = _sharded_lm,
    name: str = "fsdp",
) -> tuple[TrainingPass, TrainingPass]:
    """Both trainings of the stages ``split`` builds, step by step in turn, as the main
    demo's (``train_in_turn``); traces ``trace_{name}_{noswap,swap}.json``."""
    passes = []
    for swap in (False, True):
        stages = split(model, cfg, opts.pp * opts.vpp, mesh)
        schedule = SCHEDULE_CLASSES[opts.schedule](
            stages,
            opts.micro,
            loss_fn=model.loss_fn,
            swap=swap,
            pp=opts.pp,
            device=EmulatedDevice(),
        )
        passes.append(TrainingPass(swap, stages, schedule))

    def sgd_on_shards(stage: PipelineStage) -> None:  # with the shard gradients
        model.sgd_step(stage.parameters, stage.grads, opts.lr)

    progress = Progress(sys.stderr, len(data), label=f"{name} step")

    def report(done: int) -> None:
        times = ", ".join(f"{run.label} {run.step_times[-1]:.2f}s" for run in passes)
        progress.show(done, f"loss {passes[0].losses[-1]:.4f} ({times})")

    train_in_turn(
        passes,
        data,
        trace_of=lambda run: opts.out_dir / f"trace_{name}_{'swap' if run.swap else 'noswap'}.json",
        update=sgd_on_shards,
        report=report,
    )
    progress.close()
    return passes[0], passes[1]


def run_fsdp_demo(opts: DemoOptions, *, dp: int = 2) -> FsdpDemoReport:
    """Train the LM over a ``DeviceMesh(pp=opts.pp, dp=dp)``, swap off and on in turn.

    ``opts.batch`` is the global batch: it must divide into ``dp`` blocks of
    ``opts.micro`` micro-batches.
    """
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        raise ValueError(f"dp must be an int >= 1, got {dp!r}")
    if opts.batch % (opts.micro * dp):
        raise ValueError(
            f"batch must be divisible by micro * dp = {opts.micro * dp} (the batch is split "
            f"across dp={dp} replicas, then into micro-batches), got batch={opts.batch}"
        )
    model = load_demo_model(opts.backend)
    model.prepare()
    opts.out_dir.mkdir(parents=True, exist_ok=True)
    text = load_corpus()
    cfg = model.config(vocab=len(set(text)), **DEMO_LM_SIZES)
    data = lm_batches(text, cfg, opts.batch, opts.steps)
    mesh = DeviceMesh(pp=opts.pp, dp=dp)
    print(
        f"ppswap demo --fsdp: {opts.schedule} pp={opts.pp} vpp={opts.vpp} dp={dp} "
        f"micro={opts.micro} ({mesh.world_size} ranks), {opts.backend} char LM, "
        f"{opts.steps} steps",
        file=sys.stderr,
    )
    off, on = train_replicas(opts, model, cfg, mesh, data)
    assert off.result is not None and on.result is not None
    return FsdpDemoReport(
        dp, opts.pp, off.losses, on.losses, off.result, on.result, off.step_times, on.step_times
    )


def _cut(before: int, after: int) -> float:
    return 1 - after / before if before else 0.0


def format_fsdp_report(report: FsdpDemoReport) -> str:
    """Per world rank: parameter bytes (unsharded, between uses, peak) and saved
    activation bytes at their peak (swap off / on), then the totals."""
    same = report.losses_no_swap == report.losses_swap
    lines = [
        f"losses swap off: {' '.join(f'{v:.5f}' for v in report.losses_no_swap)}",
        f"losses swap on:  {' '.join(f'{v:.5f}' for v in report.losses_swap)}",
        f"bit-identical: {'yes' if same else 'NO'}",
        "",
    ]
    header = (
        f"{'rank':>4} {'(pp,dp)':>7} | {'params unsharded':>16} | {'between uses':>12} | "
        f"{'cut':>6} | {'peak in use':>11} | {'acts off':>10} | {'acts on':>10} | {'cut':>6}"
    )
    lines += [header, "-" * len(header)]
    for off, on in zip(report.last_no_swap.ranks, report.last_swap.ranks, strict=True):
        coords = f"({off.rank % report.pp},{off.rank // report.pp})"
        lines.append(
            f"{off.rank:>4} {coords:>7} | {on.unsharded_param_bytes:>16,} | "
            f"{on.resident_param_bytes:>12,} | "
            f"{_cut(on.unsharded_param_bytes, on.resident_param_bytes):>6.1%} | "
            f"{on.peak_param_bytes:>11,} | {off.peak_saved_bytes:>10,} | "
            f"{on.peak_saved_bytes:>10,} | {_cut(off.peak_saved_bytes, on.peak_saved_bytes):>6.1%}"
        )
    ranks_off, ranks_on = report.last_no_swap.ranks, report.last_swap.ranks
    unsharded = sum(r.unsharded_param_bytes for r in ranks_on)
    resident = sum(r.resident_param_bytes for r in ranks_on)
    acts_off = sum(r.peak_saved_bytes for r in ranks_off)
    acts_on = sum(r.peak_saved_bytes for r in ranks_on)
    lines += [
        "",
        f"parameters between uses: {resident:,} of {unsharded:,} bytes unsharded "
        f"({_cut(unsharded, resident):.1%} saved by FSDP, dp={report.dp})",
        f"activations at peak: {acts_on:,} with swap, {acts_off:,} without "
        f"({_cut(acts_off, acts_on):.1%} saved by swap)",
        f"parameters + activations: {unsharded + acts_off:,} bytes (pp only, no swap) -> "
        f"{resident + acts_on:,} (FSDP + swap, parameters between uses)",
        step_time_line(report.step_times_no_swap, report.step_times_swap),
    ]
    return "\n".join(lines)


def main_fsdp_demo(opts: DemoOptions, *, dp: int = 2) -> int:
    """Run the FSDP demo, print the report; 0 when swap on/off losses are bit-identical."""
    started = time.perf_counter()
    report = run_fsdp_demo(opts, dp=dp)
    print(format_fsdp_report(report))
    print(f"traces: {opts.out_dir}/trace_fsdp_noswap.json, {opts.out_dir}/trace_fsdp_swap.json")
    print(f"done in {time.perf_counter() - started:.1f}s")
    return 0 if report.losses_no_swap == report.losses_swap else 1
