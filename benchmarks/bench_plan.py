"""Time to lower every rank of a large schedule (issue 2's planner benchmark).

Run ``python benchmarks/bench_plan.py``. It times ``build_all_orders`` (compute order ->
FSDP -> P2P for all 32 ranks) for interleaved 1F1B with pp=32, vpp=4, FSDP and batch
P2P: first micro=256 (the target: well under 0.5 s), then micro 64/128/256/512 to show
that the time grows linearly in the number of micro-batches.

Each configuration is lowered ``--repeats`` times (best and median wall time, CPU time
of the best run); then once more per repeat with the objects that existed before the
measurement frozen (``gc.freeze()``), and one rank alone. Why the frozen column:
``import ppswap`` currently imports MindSpore (``ppswap/__init__.py`` pulls in the
runtime), which leaves ~170k GC-tracked objects in the process, and every full
collection the ~300k new MetaSteps trigger rescans them. The frozen time is what lowering
costs in a process without that baggage; the difference is garbage-collector time spent
on unrelated import state, not on the orders. The per-rank passes are linear in micro
(the one-rank column doubles when micro doubles). ``--json PATH`` writes the raw numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

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


_Result = TypeVar("_Result")


def _timed(work: Callable[[], _Result], *, freeze: bool) -> tuple[float, float, _Result]:
    gc.collect()
    if freeze:
        gc.freeze()
    try:
        wall_start = time.perf_counter()
        cpu_start = time.process_time()
        result = work()
        cpu = time.process_time() - cpu_start
        wall = time.perf_counter() - wall_start
    finally:
        if freeze:
            gc.unfreeze()
    return wall, cpu, result


def measure(config: ScheduleConfig, repeats: int) -> dict[str, Any]:
    """Lower all ranks ``repeats`` times in each condition; return the timings."""
    walls: list[float] = []
    cpus: list[float] = []
    frozen: list[float] = []
    one_rank: list[float] = []
    steps = 0
    for _ in range(repeats):
        wall, cpu, orders = _timed(lambda: build_all_orders(config), freeze=False)
        walls.append(wall)
        cpus.append(cpu)
        steps = sum(len(order) for order in orders)
        del orders
        wall, _, orders = _timed(lambda: build_all_orders(config), freeze=True)
        frozen.append(wall)
        del orders
        wall, _, _ = _timed(lambda: build_exec_order(config, ONE_RANK), freeze=False)
        one_rank.append(wall)
    best = min(range(repeats), key=walls.__getitem__)
    return {
        "micro": config.micro,
        "steps": steps,
        "best_s": walls[best],
        "median_s": statistics.median(walls),
        "cpu_best_s": cpus[best],
        "frozen_best_s": min(frozen),
        "one_rank_best_s": min(one_rank),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| micro | top-level steps | best s | median s | cpu s (best) | best s, import "
        f"state frozen | rank {ONE_RANK} alone ms |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['micro']} | {row['steps']} | {row['best_s']:.3f} | "
            f"{row['median_s']:.3f} | {row['cpu_best_s']:.3f} | {row['frozen_best_s']:.3f} | "
            f"{row['one_rank_best_s'] * 1e3:.1f} |"
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
    print(
        "build_all_orders, interleaved_1f1b pp=32 vpp=4 micro=256, fsdp, p2p=batch, "
        f"{headline['steps']} top-level steps over {args.repeats} runs:\n"
        f"  best {headline['best_s']:.3f} s, median {headline['median_s']:.3f} s; "
        f"with the import-time objects frozen {headline['frozen_best_s']:.3f} s "
        f"(target: well under {TARGET_S} s)"
    )
    print()
    growth = [measure(bench_config(micro), args.repeats) for micro in GROWTH_MICROS]
    print("Growth in micro (pp=32, vpp=4, fsdp, batch):")
    print(format_table(growth))
    first, last = growth[0], growth[-1]
    micro_ratio = last["micro"] / first["micro"]
    for label, key in (("all ranks", "best_s"), ("import state frozen", "frozen_best_s")):
        ratio = (last[key] / first[key]) / micro_ratio
        print(
            f"{label}: time ratio / micro ratio from micro={first['micro']} to "
            f"{last['micro']} = {ratio:.2f} (1.00 = linear)"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"headline": headline, "growth": growth}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
