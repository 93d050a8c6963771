"""Time to lower every rank of a large schedule (issue 2's planner benchmark).

Run ``python benchmarks/bench_plan.py``. It times ``build_all_orders`` (compute order ->
FSDP -> P2P for all 32 ranks) for interleaved 1F1B with pp=32, vpp=4, FSDP and batch
P2P: first micro=256 (the target: well under 0.5 s), then micro 64/128/256/512 to show
that the time grows linearly in the number of micro-batches.

Each configuration is lowered ``--repeats`` times; the table gives the best and the
median wall time, the CPU time of the best run, the number of top-level steps, and the
time per thousand steps (flat when the growth is linear), and the best time of lowering
one rank alone. The passes are linear per rank (the one-rank column doubles with micro);
the all-ranks time can grow a little faster at micro=512 because CPython's cyclic
garbage collector, which stays on as in real use, rescans the growing heap of finished
orders. ``--json PATH`` also writes the raw numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders, build_exec_order

HEADLINE_MICRO = 256
GROWTH_MICROS = (64, 128, 256, 512)
TARGET_S = 0.5
ONE_RANK = 5


def bench_config(micro: int) -> ScheduleConfig:
    return ScheduleConfig(
        schedule="interleaved_1f1b", pp=32, vpp=4, micro=micro, fsdp=True, p2p="batch"
    )


def measure(config: ScheduleConfig, repeats: int) -> dict[str, Any]:
    """Lower all ranks ``repeats`` times; return timings and the order sizes."""
    walls: list[float] = []
    cpus: list[float] = []
    steps = 0
    for _ in range(repeats):
        gc.collect()
        wall_start = time.perf_counter()
        cpu_start = time.process_time()
        orders = build_all_orders(config)
        cpus.append(time.process_time() - cpu_start)
        walls.append(time.perf_counter() - wall_start)
        steps = sum(len(order) for order in orders)
        del orders
    one_rank: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        build_exec_order(config, ONE_RANK)
        one_rank.append(time.perf_counter() - start)
    best = min(range(repeats), key=walls.__getitem__)
    return {
        "micro": config.micro,
        "steps": steps,
        "best_s": walls[best],
        "median_s": statistics.median(walls),
        "cpu_best_s": cpus[best],
        "ms_per_kstep": walls[best] / steps * 1e6,
        "one_rank_best_s": min(one_rank),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    header = (
        "| micro | top-level steps | best s | median s | cpu s (best) | ms / 1k steps "
        f"| rank {ONE_RANK} alone ms |"
    )
    lines = [header, "|---:|---:|---:|---:|---:|---:|---:|"]
    for row in rows:
        lines.append(
            f"| {row['micro']} | {row['steps']} | {row['best_s']:.3f} | "
            f"{row['median_s']:.3f} | {row['cpu_best_s']:.3f} | "
            f"{row['ms_per_kstep']:.3f} | {row['one_rank_best_s'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="write raw numbers here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")

    headline = measure(bench_config(HEADLINE_MICRO), args.repeats)
    verdict = "meets" if headline["best_s"] < TARGET_S else "MISSES"
    print(
        "build_all_orders, interleaved_1f1b pp=32 vpp=4 micro=256, fsdp, p2p=batch: "
        f"best {headline['best_s']:.3f} s, median {headline['median_s']:.3f} s over "
        f"{args.repeats} runs ({verdict} the {TARGET_S} s target)"
    )
    print()
    growth = [measure(bench_config(micro), args.repeats) for micro in GROWTH_MICROS]
    print("Growth in micro (pp=32, vpp=4, fsdp, batch):")
    print(format_table(growth))
    first, last = growth[0], growth[-1]
    ratio = (last["best_s"] / first["best_s"]) / (last["micro"] / first["micro"])
    print(
        f"\ntime ratio / micro ratio from micro={first['micro']} to {last['micro']}: "
        f"{ratio:.2f} (1.00 = linear)"
    )
    if args.json is not None:
        args.json.write_text(json.dumps({"headline": headline, "growth": growth}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
