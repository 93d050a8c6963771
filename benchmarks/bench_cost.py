"""What swap costs: step time and exposed copy wait with throttled copies, for the fixed gap
rule and the cost-aware policy side by side.

    python benchmarks/bench_cost.py [--repeats N] [--json PATH]

Same LM and schedules as ``bench_memory.py`` (GPipe, 1F1B, Interleaved; pp4, m8). Each
schedule is calibrated on itself first:

- the *compute slot* is one compute leaf's wall time: no-swap step time / compute leaves
  (the in-process runtime runs every leaf of every rank on one compute thread, so a step
  is the sum of its leaves); the same with swap on and copies unthrottled (the default
  engine, which the first stage keeps across runs, as a user's runs get it) gives the
  slowdown swap itself causes (``--calibration-repeats`` runs each, default 5, medians;
  runs without and with swap alternate, so the machine's drift reaches both alike);
- a *chunk* is what one chunk's offload moves (``RankStats.offloaded_bytes`` per offloaded
  chunk, per rank).

Then for copies of half a slot, and 2x and 4x that (one and two slots): every swap run
is preceded by a fresh no-swap step that gives the slot *of that moment*, and
``EmulatedDevice(d2h_gbps=..., h2d_gbps=...)`` is set so one chunk's copy takes that many
slots (the machine's speed drifts by up to 2x within minutes while a throttled copy is an
absolute time; a bandwidth fixed once per setting let the rows measure the drift: a plan
made in a slow phase and run in a fast one saw copies of 3 slots instead of 2). The fixed
rule (``swap_policy="gap"``) runs ``--repeats`` times: the user's first run, before asking
for a cost plan. Its runs and the no-swap steps before them give the ``CostModel``'s
inputs, each run's times scaled to the median slot (a plan depends only on ratios of
times): from ``RankStats.compute_job_s`` / ``compute_jobs`` the mean forward, backward
and swap-step job on the compute thread in the swap runs, each plus the no-swap steps'
thread time outside jobs spread over their jobs (``leaf_s``, ``backward_leaf_s``,
``swap_step_s``; that time per job is also ``p2p_latency_s``; a swap run's time outside
jobs also holds its exposed waits), and the copy's fixed cost
(``copy_busy_s`` beyond ``bytes / bandwidth``, per copy); budget 2% of the step,
``headroom`` 0.5, ``shared_compute=True``. Then the cost-aware policy
(``swap_policy="cost"``) runs ``--repeats`` times, each again at the slot of its moment.
Each row is the median run by exposed share. Where the cost policy chooses the fixed
rule's chunks the run is the same and is not repeated.

Per row: the step time, the exposed copy wait (``RankStats.exposed_copy_wait_s``: time the
compute actor was blocked in SWAP_WAIT_*) of the worst rank as a share of the step time,
the planner's prediction of it, the share of copy time hidden behind compute
(``1 - sum(exposed) / sum(copy_busy_s)`` over ranks) and the peak saved bytes of the
largest rank. The checks at the end are the issue's done-when conditions on these rows.

MindSpore runs with ``pynative_synchronize=True`` (see ``bench_memory.py``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from bench_memory import CASES, BenchCase, Runner, configure_mindspore, mib

from ppswap import RunResult
from ppswap.actors.compute import JOB_KINDS
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import DEFAULT_COST_BUDGET, CostModel, plan_cost_aware
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.swap_plan import eligible_chunks
from ppswap.swap import EmulatedDevice

COPY_SLOTS = (0.5, 1.0, 2.0)  # one chunk's copy, in compute slots: half a slot, 2x, 4x
COST_CASES = CASES[:3]  # GPipe, 1F1B, Interleaved
EXPOSED_TARGET = 0.05  # the bound for the default plan at the half-slot setting
# The cost plan's prediction may use half the budget: one plan's measured wait varies by a
# few points of the step from run to run on this shared machine (docs/benchmarks.md).
HEADROOM = 0.5


def compute_leaves(config: ScheduleConfig) -> int:
    """Compute leaves of one step over all ranks (BWD_WEIGHT counts with split_dw)."""
    per_chunk = 3 if config.split_dw else 2
    return config.micro * config.num_stages * per_chunk - (
        config.micro if config.split_dw else 0  # stage 0 keeps a unified BWD
    )


def memcpy_gbps(nbytes: int) -> float:
    """This machine's plain memcpy bandwidth for ``nbytes`` (best of 5), in GB/s."""
    source = np.ones(max(nbytes, 1), np.uint8)
    target = np.empty_like(source)
    best = math.inf
    for _ in range(5):
        started = time.perf_counter()
        np.copyto(target, source)
        best = min(best, time.perf_counter() - started)
    return source.nbytes / best / 1e9


def calibrate(runner: Runner, repeats: int) -> dict[str, Any]:
    """The case's compute slot without and with swap, bytes per chunk and per-copy cost.

    The slot without swap sets the throttles; the slot *with* swap (an unthrottled swap
    run: the swap work on the compute thread and the capture hooks make every slot longer)
    is the cost model's ``leaf_s``, since the plan predicts swap runs. The fixed cost per
    copy is the unthrottled copy time beyond a plain memcpy of its bytes (a throttled copy
    sleeps until ``bytes / bandwidth`` has passed, so its memcpy is inside that term).
    """
    config = runner.case.config
    leaves = compute_leaves(config)
    runner.run(swap=False)  # warm-up
    runner.run(swap=True)
    plain: list[dict[str, Any]] = []
    swapped: list[RunResult] = []
    for _ in range(repeats):  # alternating: a drift of the machine reaches both alike
        plain.append(summarize(runner.run(swap=False)))
        swapped.append(runner.run(swap=True))
    step_no_swap = statistics.median(run["step_s"] for run in plain)
    step_swap = statistics.median(run.step_time_s for run in swapped)
    last = swapped[-1]
    rank_bytes = [
        rank.offloaded_bytes // (rank.copies // 2) if rank.copies else 0 for rank in last.ranks
    ]
    chunk_bytes = max(rank_bytes)
    copies = sum(rank.copies for rank in last.ranks)
    per_copy = sum(rank.copy_busy_s for rank in last.ranks) / copies if copies else 0.0
    memcpy_s = chunk_bytes / (memcpy_gbps(chunk_bytes) * 1e9)
    return {
        "no_swap": median_run(plain),
        "swap_unthrottled": median_run([summarize(run) for run in swapped]),
        "slot_s": step_no_swap / leaves,
        "slot_swap_s": step_swap / leaves,
        "stage_bytes": tuple(rank_bytes[config.rank_of(s)] for s in range(config.num_stages)),
        "chunk_bytes": chunk_bytes,
        "copy_overhead_s": max(0.0, per_copy - memcpy_s),
        "memcpy_s": memcpy_s,
    }


def job_times(
    plain: list[RunResult], swapped: list[RunResult], scales: list[float]
) -> dict[str, float]:
    """Mean forward, backward and swap-step job on the compute thread in the swap runs
    ``swapped``, each plus the thread's time outside jobs in the no-swap runs ``plain``
    (event loop, P2P, dispatch) spread over their jobs: the thread cannot start the next
    job during it. Each run's times are multiplied by its entry of ``scales`` (to a
    reference machine speed, see ``throttled_runs``).

    The jobs come from the swap runs: there a leaf also runs the capture hooks and shares
    the CPU with the copy threads (10-20% longer here). The time outside jobs comes from
    the runs without swap: in a swap run it also holds the exposed copy waits (the thread
    idles while every rank waits), and spreading those over the jobs would make compute
    look longer and copies better hidden than they are.
    """
    swap_kinds = ("swap_prepare", "swap_finish")

    def totals(results: list[RunResult]) -> tuple[dict[str, float], dict[str, int], float]:
        seconds = dict.fromkeys(JOB_KINDS, 0.0)
        counts = dict.fromkeys(JOB_KINDS, 0)
        steps = 0.0
        for result, scale in zip(results, scales, strict=True):
            steps += scale * result.step_time_s
            for rank in result.ranks:
                for kind in JOB_KINDS:
                    seconds[kind] += scale * rank.compute_job_s[kind]
                    counts[kind] += rank.compute_jobs[kind]
        return seconds, counts, steps

    plain_s, plain_counts, plain_steps = totals(plain)
    idle_s = max(0.0, plain_steps - sum(plain_s.values())) / max(1, sum(plain_counts.values()))
    seconds, counts, _ = totals(swapped)
    swap_jobs = sum(counts[kind] for kind in swap_kinds)
    return {
        "forward_s": seconds["forward"] / max(1, counts["forward"]) + idle_s,
        "backward_s": seconds["backward"] / max(1, counts["backward"]) + idle_s,
        "swap_step_s": sum(seconds[kind] for kind in swap_kinds) / max(1, swap_jobs) + idle_s,
        "idle_s": idle_s,
    }


class ThrottledRun(NamedTuple):
    """A swap run, the no-swap step right before it, its slot and its copy bandwidth."""

    result: RunResult
    plain: RunResult
    slot_s: float
    gbps: float


def throttled_runs(
    runner: Runner, copy_slots: float, chunk_bytes: int, repeats: int, **run_kwargs: Any
) -> list[ThrottledRun]:
    """``repeats`` swap runs with one chunk's copy throttled to ``copy_slots`` compute slots
    *of that moment*.

    Before each run a no-swap step measures the slot. The machine's speed drifts by up to
    2x within minutes (other work on the host), while a throttled copy is an absolute
    time: a bandwidth fixed once would make the copies of a run in a fast phase cost
    more slots than they were set to, and the rows would measure the drift instead of the
    plans.
    """
    leaves = compute_leaves(runner.case.config)
    runs = []
    for _ in range(repeats):
        plain = runner.run(swap=False)
        slot_s = plain.step_time_s / leaves
        gbps = chunk_bytes / (copy_slots * slot_s * 1e9)
        device = EmulatedDevice(d2h_gbps=gbps, h2d_gbps=gbps)
        result = runner.run(swap=True, device=device, **run_kwargs)
        runs.append(ThrottledRun(result, plain, slot_s, gbps))
    return runs


def summarize(result: RunResult) -> dict[str, Any]:
    step = result.step_time_s
    exposed = [r.exposed_copy_wait_s for r in result.ranks]
    busy = sum(r.copy_busy_s for r in result.ranks)
    return {
        "step_s": step,
        "exposed_share": max(exposed) / step,
        "hidden_share": 1 - sum(exposed) / busy if busy else None,
        "copy_busy_s": busy,
        "peak_bytes": max(r.peak_saved_bytes for r in result.ranks),
        "chunks": sum(r.copies for r in result.ranks) // 2,
    }


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of each measure over ``runs``: step time, exposed share and hidden share
    each their own median (the step time of the run with the median exposed share would be
    one arbitrary run's); the rest from the run with the median exposed share."""
    ordered = sorted(runs, key=lambda run: run["exposed_share"])
    middle = dict(ordered[len(ordered) // 2])
    middle["step_s"] = statistics.median(run["step_s"] for run in runs)
    hidden = [run["hidden_share"] for run in runs if run["hidden_share"] is not None]
    middle["hidden_share"] = statistics.median(hidden) if hidden else None
    return middle


def measure_case(
    case: BenchCase, repeats: int, calibration_repeats: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Calibrate on the case itself, then the throttled rows (module docstring)."""
    runner = Runner(case)
    calibration = calibrate(runner, calibration_repeats)
    rows = [
        {"schedule": case.name, "copy_slots": None, "policy": "no swap", **calibration["no_swap"]},
        {
            "schedule": case.name,
            "copy_slots": 0.0,
            "policy": "gap",
            **calibration["swap_unthrottled"],
        },
    ]
    fixed_chunks = sum(
        len(eligible_chunks(order)) for order in build_all_orders(replace(case.config, swap=True))
    )
    chunk_bytes = calibration["chunk_bytes"]
    for slots in COPY_SLOTS:
        gap_runs = throttled_runs(runner, slots, chunk_bytes, repeats)
        gap_results = [run.result for run in gap_runs]
        # The cost model in the units of a reference slot (the median of the runs'), each
        # run's times scaled to it: a plan depends only on ratios of times, so it holds at
        # whatever speed the machine runs, as long as the copies keep their share of a slot.
        slot_s = statistics.median(run.slot_s for run in gap_runs)
        scales = [slot_s / run.slot_s for run in gap_runs]
        gbps = chunk_bytes / (slots * slot_s * 1e9)
        # What a copy at this bandwidth takes beyond bytes / bandwidth, measured on the
        # fixed rule's runs (the user's first run, before asking for a cost plan).
        copies = sum(rank.copies for result in gap_results for rank in result.ranks)
        beyond_s = sum(
            scale
            * sum(
                rank.copy_busy_s - (rank.offloaded_bytes + rank.loaded_bytes) / (run.gbps * 1e9)
                for rank in run.result.ranks
            )
            for run, scale in zip(gap_runs, scales, strict=True)
        )
        jobs = job_times([run.plain for run in gap_runs], gap_results, scales)
        cost = CostModel(
            chunk_bytes=calibration["stage_bytes"],
            d2h_gbps=gbps,
            h2d_gbps=gbps,
            leaf_s=jobs["forward_s"],
            backward_leaf_s=jobs["backward_s"],
            swap_step_s=jobs["swap_step_s"],
            # an activation reaches the next rank through the event loop, whose latency is
            # what the thread's time between jobs measures
            p2p_latency_s=jobs["idle_s"],
            budget=DEFAULT_COST_BUDGET,
            headroom=HEADROOM,
            copy_overhead_s=max(0.0, beyond_s / max(1, copies)),
            shared_compute=True,
        )
        plan = plan_cost_aware(case.config, cost)
        same = len(plan.chunks) == fixed_chunks
        cost_runs = [
            summarize(run.result)
            for run in throttled_runs(
                runner,
                slots,
                chunk_bytes,
                0 if same else repeats,
                swap_policy="cost",
                cost_model=cost,
            )
        ]
        gap = median_run([summarize(result) for result in gap_results])
        common = {"schedule": case.name, "copy_slots": slots, "gbps": gbps, "slot_s": slot_s}
        rows.append(
            {
                **common,
                "policy": "gap",
                "predicted_share": max(r.exposed_s_gap for r in plan.ranks) / plan.step_s,
                **gap,
            }
        )
        rows.append(
            {
                **common,
                "policy": "cost",
                "predicted_share": max(r.exposed_s for r in plan.ranks) / plan.step_s,
                "same_as_gap": same,
                **(gap if same else median_run(cost_runs)),
            }
        )
    return calibration, rows


def pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| schedule | copy / slot | slot ms | policy | swapped chunks | step s "
        "| exposed (worst rank) | predicted | copy hidden | peak MiB (largest rank) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        slots = r["copy_slots"]
        slots = "-" if slots is None else "unthrottled" if slots == 0 else f"{slots:g}"
        slot_ms = f"{1e3 * r['slot_s']:.1f}" if "slot_s" in r else "-"
        policy = r["policy"] + (" (= gap)" if r.get("same_as_gap") else "")
        lines.append(
            f"| {r['schedule']} | {slots} | {slot_ms} | {policy} | {r['chunks']} | "
            f"{r['step_s']:.2f} | {'-' if r['copy_slots'] is None else pct(r['exposed_share'])} "
            f"| {pct(r.get('predicted_share'))} | {pct(r['hidden_share'])} | "
            f"{mib(r['peak_bytes'])} |"
        )
    return "\n".join(lines)


def checks(rows: list[dict[str, Any]]) -> list[str]:
    """The issue's done-when lines, evaluated on the measured rows."""
    out = []
    for r in rows:
        half_slot = r["policy"] == "gap" and r["copy_slots"] == COPY_SLOTS[0]
        if half_slot and r["schedule"].startswith(("GPipe", "Interleaved")):
            ok = r["exposed_share"] <= EXPOSED_TARGET
            out.append(
                f"- {'PASS' if ok else 'FAIL'}: {r['schedule']}, half-slot copies, default "
                f"plan: exposed {pct(r['exposed_share'])} <= {pct(EXPOSED_TARGET)}"
            )
    for r in rows:
        if r["policy"] != "cost":
            continue
        gap = next(
            g
            for g in rows
            if g["schedule"] == r["schedule"]
            and g["copy_slots"] == r["copy_slots"]
            and g["policy"] == "gap"
        )
        ok = r["exposed_share"] <= DEFAULT_COST_BUDGET
        line = (
            f"- {'PASS' if ok else 'FAIL'}: {r['schedule']}, copy {r['copy_slots']:g} slot, "
            f"cost policy: exposed {pct(r['exposed_share'])} <= {pct(DEFAULT_COST_BUDGET)}"
        )
        if gap["exposed_share"] <= DEFAULT_COST_BUDGET:
            no_worse = r["peak_bytes"] <= gap["peak_bytes"]
            line += (
                f"; fixed rule also within budget ({pct(gap['exposed_share'])}): peak "
                f"{mib(r['peak_bytes'])} vs {mib(gap['peak_bytes'])} MiB "
                f"{'PASS' if no_worse else 'FAIL'}"
            )
        out.append(line)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs per measured row")
    parser.add_argument(
        "--calibration-repeats",
        type=int,
        default=5,
        help="runs without and with swap (unthrottled) per schedule: the step-time ratio",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the raw rows here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.calibration_repeats < 1:
        parser.error(f"--calibration-repeats must be >= 1, got {args.calibration_repeats}")
    configure_mindspore()
    started = time.perf_counter()
    calibrations: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    for case in COST_CASES:
        calibration, case_rows = measure_case(case, args.repeats, args.calibration_repeats)
        calibrations[case.name] = calibration
        rows.extend(case_rows)
    print("Calibration per schedule (medians of the runs):\n")
    print(
        "| schedule | compute slot ms (no swap) | slot ms (swap, unthrottled) | chunk bytes "
        "| per-copy cost ms | copy settings (ms per chunk, GB/s) |"
    )
    print("|---|---:|---:|---:|---:|---|")
    for name, cal in calibrations.items():
        settings = ", ".join(
            f"{s:g} slot: {1e3 * s * cal['slot_s']:.1f} ms, "
            f"{cal['chunk_bytes'] / (s * cal['slot_s'] * 1e9):.3f} GB/s"
            for s in COPY_SLOTS
        )
        print(
            f"| {name} | {1e3 * cal['slot_s']:.1f} | {1e3 * cal['slot_swap_s']:.1f} | "
            f"{cal['chunk_bytes']} | {1e3 * cal['copy_overhead_s']:.2f} | {settings} |"
        )
    print()
    print(table(rows))
    print("\nChecks (issue 9, done-when):\n")
    print("\n".join(checks(rows)))
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json is not None:
        payload = {"calibration": calibrations, "rows": rows}
        args.json.write_text(json.dumps(payload, indent=2, default=list))
    return 0


if __name__ == "__main__":
    sys.exit(main())
