"""Orchestration cost of the actor runtime per MetaStep, and event-loop lag while training.

Both sides execute the *same* finalized orders over the *same* stages with the same swap
session calls and copy jobs:

- ``sync``: a plain synchronous loop on one thread, rank by rank, running each step as soon
  as its input message exists (the cheapest correct executor of these orders);
- ``actors``: ``run_schedule`` (compute / copy / P2P actors, channels, reply futures, the
  dedicated compute thread and copy threads).

Overhead per MetaStep = (actors - sync) / top-level steps executed, as a slope over two
sizes of each schedule, in wall time and in CPU time (``time.process_time``: every thread
of the process). Each repeat runs the four series (sync and actors, each size) back to
back and the slope is taken from each series' median, so a slow spell of the machine
moves one run of each series, not a whole series. The stages are trivial (one 4x4 Dense)
so MindSpore's own cost is small, and both sides pay it. With ``overlap_b_f`` the sync
loop runs each leaf of a composite once its input is there. On this shared 2-core machine
the wall time of the same sync loop varies by up to 40% from run to run, so the CPU-time
column is the steadier figure; the wall-time one includes what the runtime's threads wait
for each other.
A heartbeat task on the runtime's loop measures scheduling lag (p50/p99/max) in runs of
their own (its 1 ms wake-ups would otherwise be counted as the runtime's overhead).

    python benchmarks/bench_runtime.py [--repeats 9] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import mindspore as ms
import numpy as np
import numpy.typing as npt
from mindspore import Tensor, nn

from ppswap import PipelineStage, RunOptions, run_schedule
from ppswap.backends.mindspore import BACKEND as MINDSPORE
from ppswap.demo.model import mse_loss
from ppswap.planning.prepare import prepare_run, split_batches
from ppswap.scheduler.config import ScheduleName
from ppswap.scheduler.steps import MetaStep, StepKind
from ppswap.scheduler.swap_plan import eligible_chunks
from ppswap.stage_run import StageRun
from ppswap.swap import EmulatedDevice, PipelineSwapSession, SwapManager, swap_wrapper

HostArray = npt.NDArray[Any]

CONFIGS: list[tuple[ScheduleName, int, int, int, bool, bool]] = [
    # schedule, pp, stages, micro, swap, overlap_b_f
    ("gpipe", 4, 4, 8, False, False),
    ("1f1b", 4, 4, 8, True, False),
    ("interleaved_1f1b", 2, 4, 8, True, False),
    ("1f1b", 4, 4, 8, True, True),
]


def _stages(stage_num: int) -> list[PipelineStage]:
    ms.set_seed(0)
    return [
        PipelineStage(nn.SequentialCell([swap_wrapper(nn.Dense(4, 4))]), i, stage_num)
        for i in range(stage_num)
    ]


def _data(batch: int) -> tuple[HostArray, HostArray]:
    rng = np.random.default_rng(0)
    return (
        rng.standard_normal((batch, 4)).astype(np.float32),
        rng.standard_normal((batch, 4)).astype(np.float32),
    )


class SyncExecutor:
    """Runs the finalized orders of every rank on this thread, no actors, no channels."""

    def __init__(
        self,
        stages: list[PipelineStage],
        schedule: ScheduleName,
        pp: int,
        micro: int,
        swap: bool,
        overlap_b_f: bool = False,
    ) -> None:
        x, y = _data(micro * 2)
        options = RunOptions(
            schedule=schedule, micro_batch_num=micro, swap=swap, pp=pp, overlap_b_f=overlap_b_f
        )
        self.plan = prepare_run(stages, options, inputs=x, targets=y, loss_fn=mse_loss, trace=None)
        self.stages = {s.stage_index: s for s in stages}
        self.runs: dict[int, StageRun] = {}

    def run(self) -> int:
        plan = self.plan
        config = plan.config
        batches = split_batches(plan)
        engine = EmulatedDevice()
        self.runs = {
            index: StageRun(stage, micro_count=config.micro, loss_fn=mse_loss)
            for index, stage in self.stages.items()
        }
        sessions = {
            r: PipelineSwapSession(
                SwapManager(plan.backend),
                engine,
                rank=r,
                generation=1,
                eligible=eligible_chunks(plan.orders[r]),
            )
            for r in range(config.pp)
        }
        mailbox: dict[tuple[str, int, int], HostArray] = {}
        outbox: dict[tuple[str, int, int], HostArray] = {}
        cursor = [0] * config.pp
        leaves_done: list[set[MetaStep]] = [set() for _ in range(config.pp)]
        executed = 0
        while any(cursor[r] < len(plan.orders[r]) for r in range(config.pp)):
            progressed = False
            for rank in range(config.pp):
                order = plan.orders[rank]
                while cursor[rank] < len(order):
                    step = order[cursor[rank]]
                    if step.sub_steps:  # a composite: each leaf once its input is there
                        done = leaves_done[rank]
                        for leaf in step.sub_steps:
                            if leaf not in done and self._ready(leaf, mailbox):
                                self._execute(leaf, sessions[rank], batches, mailbox, outbox)
                                done.add(leaf)
                                executed += 1  # run_schedule counts the leaves too
                                progressed = True
                        if len(done) < len(step.sub_steps):
                            break
                        done.clear()
                    elif not self._ready(step, mailbox):
                        break
                    else:
                        self._execute(step, sessions[rank], batches, mailbox, outbox)
                    cursor[rank] += 1
                    executed += 1
                    progressed = True
            if not progressed:
                raise RuntimeError("sync executor stuck")
        for session in sessions.values():
            session.close()
        return executed

    def _ready(self, step: MetaStep, mailbox: dict[tuple[str, int, int], HostArray]) -> bool:
        stage = self.stages.get(step.stage)
        if step.kind is StepKind.FWD and stage is not None and not stage.is_first:
            return ("F", step.stage, step.micro) in mailbox
        if step.kind is StepKind.BWD and stage is not None and not stage.is_last:
            return ("B", step.stage, step.micro) in mailbox
        return True

    def _execute(
        self,
        step: MetaStep,
        session: PipelineSwapSession,
        batches: Any,
        mailbox: dict[tuple[str, int, int], HostArray],
        outbox: dict[tuple[str, int, int], HostArray],
    ) -> None:
        kind = step.kind
        if kind is StepKind.FWD:
            stage = self.runs[step.stage]
            payload = (
                batches.inputs[step.micro]
                if stage.is_first
                else mailbox.pop(("F", step.stage, step.micro))
            )
            target = Tensor.from_numpy(batches.targets[step.micro]) if stage.is_last else None
            out = stage.forward(step.micro, Tensor.from_numpy(payload), target, session)
            assert not isinstance(out, tuple)  # one tensor between these stages
            if not stage.is_last:
                outbox[("F", step.stage + 1, step.micro)] = out.asnumpy().copy()
        elif kind is StepKind.BWD:
            stage = self.runs[step.stage]
            grad = None if stage.is_last else mailbox.pop(("B", step.stage, step.micro))
            dx = stage.backward(
                step.micro, None if grad is None else Tensor.from_numpy(grad), split=False
            )
            session.release_chunk(step.stage, step.micro)
            assert not isinstance(dx, tuple)
            if dx is not None:
                outbox[("B", step.stage - 1, step.micro)] = dx.asnumpy().copy()
        elif kind in (StepKind.SEND_F, StepKind.SEND_B):
            key = (
                ("F", step.stage + 1, step.micro)
                if kind is StepKind.SEND_F
                else ("B", step.stage - 1, step.micro)
            )
            mailbox[key] = outbox.pop(key)
        elif kind is StepKind.SWAP_LAUNCH_OFFLOAD:
            session.prepare_offload(step.stage, step.micro).run()
        elif kind is StepKind.SWAP_WAIT_OFFLOAD:
            session.finish_offload(step.stage, step.micro)
        elif kind is StepKind.SWAP_LAUNCH_LOAD:
            session.prepare_load(step.stage, step.micro).run()
        elif kind is StepKind.SWAP_WAIT_LOAD:
            session.finish_load(step.stage, step.micro)
        # RECV_*: the message is already in the mailbox when its consumer is ready.


async def _actors_run(
    stages: list[PipelineStage],
    schedule: ScheduleName,
    pp: int,
    micro: int,
    swap: bool,
    overlap_b_f: bool,
    lags: list[float] | None,
) -> tuple[float, float, int]:
    """One run: wall and CPU seconds, steps. With ``lags``, a heartbeat task beside it
    records the loop's lag (its own wake-ups cost the loop time, so timed runs go without
    it)."""
    x, y = _data(micro * 2)

    async def heartbeat(lags: list[float]) -> None:
        while True:
            started = time.perf_counter()
            await anyio.sleep(0.001)
            lags.append(time.perf_counter() - started - 0.001)

    async with anyio.create_task_group() as tg:
        if lags is not None:
            tg.start_soon(heartbeat, lags)
        started, cpu_started = time.perf_counter(), time.process_time()
        result = await run_schedule(
            stages,
            schedule,
            micro_batch_num=micro,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=swap,
            pp=pp,
            overlap_b_f=overlap_b_f,
        )
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        tg.cancel_scope.cancel()
    return wall, cpu, sum(r.steps_executed for r in result.ranks)


Sample = tuple[float, float]
"""One run: wall and CPU seconds."""
SIZES = (1, 4)
"""The two sizes of each configuration, as multiples of its micro-batch count."""


@dataclass
class Series:
    """Every run of one configuration: by ``(contender, micro)`` the samples, in repeat
    order, and the top-level steps of each size."""

    micros: tuple[int, int]
    steps: dict[int, int] = field(default_factory=dict)
    samples: dict[tuple[str, int], list[Sample]] = field(default_factory=dict)

    def overheads(self, index: int) -> list[float]:
        """Per repeat, the seconds per MetaStep the actors add over the sync loop (wall:
        ``index`` 0, CPU: 1): the slope between the two sizes, from the four runs of
        that repeat, which ran back to back (their spread is the run-to-run noise)."""
        repeats = len(self.samples[("sync", self.micros[0])])
        return [
            self._slope({k: runs[r][index] for k, runs in self.samples.items()})
            for r in range(repeats)
        ]

    def overhead(self, index: int, pick: Callable[[list[float]], float]) -> float:
        """The slope from one figure of each of the four series: ``statistics.median``
        (the table's figure), or ``min`` (the best runs, as timeit reports: other load
        only adds time)."""
        return self._slope({k: pick([v[index] for v in runs]) for k, runs in self.samples.items()})

    def _slope(self, figure: dict[tuple[str, int], float]) -> float:
        """Seconds per MetaStep: the actors' growth between the sizes minus the sync loop's."""
        small, large = self.micros
        extra = self.steps[large] - self.steps[small]
        actors = figure[("actors", large)] - figure[("actors", small)]
        return (actors - (figure[("sync", large)] - figure[("sync", small)])) / extra

    def median(self, contender: str, micro: int, index: int = 0) -> float:
        return statistics.median(v[index] for v in self.samples[(contender, micro)])


def _measure(
    schedule: ScheduleName,
    pp: int,
    stage_num: int,
    micro: int,
    swap: bool,
    overlap_b_f: bool,
    repeats: int,
    lags: list[float],
) -> Series:
    """Wall and CPU times of the sync loop and of run_schedule over the same orders, at
    ``micro`` and ``4 * micro``: each repeat runs all four back to back, starting one
    further along each time (so no contender or size always runs first); then one run
    with the heartbeat for the loop's lag."""
    stages = _stages(stage_num)
    micros = (micro * SIZES[0], micro * SIZES[1])
    series = Series(micros)
    syncs = {m: SyncExecutor(stages, schedule, pp, m, swap, overlap_b_f) for m in micros}
    for m in micros:  # warm-up
        syncs[m].run()
        anyio.run(_actors_run, stages, schedule, pp, m, swap, overlap_b_f, None)
    runs = [(contender, m) for m in micros for contender in ("sync", "actors")]
    for key in runs:
        series.samples[key] = []
    for repeat in range(repeats):
        shift = repeat % len(runs)
        for contender, m in runs[shift:] + runs[:shift]:
            if contender == "sync":
                started, cpu_started = time.perf_counter(), time.process_time()
                steps = syncs[m].run()
                sample = (time.perf_counter() - started, time.process_time() - cpu_started)
            else:
                wall, cpu, steps = anyio.run(
                    _actors_run, stages, schedule, pp, m, swap, overlap_b_f, None
                )
                sample = (wall, cpu)
            assert series.steps.setdefault(m, steps) == steps, (m, steps)
            series.samples[(contender, m)].append(sample)
    anyio.run(_actors_run, stages, schedule, pp, micros[1], swap, overlap_b_f, lags)
    return series


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")
    with MINDSPORE.run_scope():  # the sync loop runs as run_schedule does
        rows, lag = _measure_all(args.repeats)
    _report(rows, lag, args.json)


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, q3


def _measure_all(repeats: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    rows = []
    all_lags: list[float] = []
    for schedule, pp, stage_num, micro, swap, overlap_b_f in CONFIGS:
        # Two sizes of the same schedule: the slope is the cost per MetaStep, free of the
        # fixed per-run costs (planning and validation, thread start and join).
        series = _measure(schedule, pp, stage_num, micro, swap, overlap_b_f, repeats, all_lags)
        small, large = series.micros
        wall = series.overhead(0, statistics.median)
        fixed = series.median("actors", small) - series.median("sync", small)
        q1, q3 = _quartiles(series.overheads(0))
        rows.append(
            {
                "schedule": f"{schedule} + overlap_b_f" if overlap_b_f else schedule,
                "pp": pp,
                "stages": stage_num,
                "micro": f"{small} / {large}",
                "swap": swap,
                "steps": f"{series.steps[small]} / {series.steps[large]}",
                "sync_ms": f"{series.median('sync', small) * 1e3:.0f} / "
                f"{series.median('sync', large) * 1e3:.0f}",
                "actors_ms": f"{series.median('actors', small) * 1e3:.0f} / "
                f"{series.median('actors', large) * 1e3:.0f}",
                "fixed_ms": (fixed - wall * series.steps[small]) * 1e3,
                "overhead_us_per_step": wall * 1e6,
                "overhead_quartiles_us": (q1 * 1e6, q3 * 1e6),
                "cpu_overhead_us_per_step": series.overhead(1, statistics.median) * 1e6,
                "best_overhead_us_per_step": series.overhead(0, min) * 1e6,
                "best_cpu_overhead_us_per_step": series.overhead(1, min) * 1e6,
                "repeats": repeats,
            }
        )
    lags_ms = sorted(v * 1e3 for v in all_lags)
    lag = {
        "samples": len(lags_ms),
        "p50_ms": lags_ms[len(lags_ms) // 2],
        "p99_ms": lags_ms[int(len(lags_ms) * 0.99)],
        "max_ms": lags_ms[-1],
    }
    return rows, lag


def _report(rows: list[dict[str, Any]], lag: dict[str, Any], json_path: str | None) -> None:
    print(
        "| schedule | pp | stages | micro | swap | MetaSteps | sync loop ms | actors ms "
        "| fixed per run ms | overhead us/MetaStep, wall | wall, quartiles "
        "| overhead us/MetaStep, CPU | best runs: wall | best runs: CPU |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        q1, q3 = r["overhead_quartiles_us"]
        print(
            f"| {r['schedule']} | {r['pp']} | {r['stages']} | {r['micro']} | {r['swap']} "
            f"| {r['steps']} | {r['sync_ms']} | {r['actors_ms']} | {r['fixed_ms']:.1f} "
            f"| {r['overhead_us_per_step']:.1f} | {q1:.0f} .. {q3:.0f} "
            f"| {r['cpu_overhead_us_per_step']:.1f} "
            f"| {r['best_overhead_us_per_step']:.1f} | {r['best_cpu_overhead_us_per_step']:.1f} |"
        )
    print()
    print(
        "overhead per MetaStep = slope of run_schedule's time over MetaSteps minus the "
        "sync loop's slope (micro and 4x micro; each time the median of "
        f"{rows[0]['repeats']} repeats, the four series interleaved: each repeat runs all "
        "four back to back, starting one further along), in wall time and in CPU time of "
        "the whole process; wall, quartiles: of the slopes of single repeats (the "
        "run-to-run noise); fixed per run = the rest of the wall time at micro (planning, "
        "validation, threads); best runs: the same slopes from the least time of each "
        "series (as timeit reports: other load only adds time)."
    )
    print(
        f"event-loop lag while training ({lag['samples']} heartbeats of 1 ms): "
        f"p50 {lag['p50_ms']:.2f} ms, p99 {lag['p99_ms']:.2f} ms, max {lag['max_ms']:.2f} ms"
    )
    if json_path:
        with open(json_path, "w") as handle:
            json.dump({"rows": rows, "lag": lag}, handle, indent=2)


if __name__ == "__main__":
    main()
