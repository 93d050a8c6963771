"""Scale on paper: what ``ppswap plan --swap`` predicts for pp up to 64, vpp up to 4 and
micro up to 1024, and how long planning takes.

    python benchmarks/bench_scale.py [--quick] [--json PATH]

Nothing runs a model here: every figure is the planner's. For each schedule the orders are
lowered with ``swap=True`` (plain P2P, no FSDP, ``min_swap_gap`` 4) and

- memory: ``simulate.memory_profile`` gives each rank's peak of resident activation chunks
  without and with swap (the table shows the largest rank, which sizes the device);
- bubbles: ``simulate.build_timeline`` places every compute slot on the global logical
  timeline; the bubble share is the idle columns of the busiest-idle rank over all columns;
- time: wall seconds of lowering every rank (``build_all_orders``: compute order -> P2P ->
  swap steps), of the timeline and of the memory profiles, with the objects alive before
  the measurement frozen (``gc.freeze()``: whatever the process imported is not rescanned
  by the full collections the millions of new MetaSteps trigger, so the figure is the
  planner's own).

The growth table doubles micro at pp=64 for the largest family (interleaved, vpp=4): the
time per top-level step stays flat when planning is linear, and the "one rank" column (one
rank's lowering alone) doubles with micro. What grows faster than linear in the all-ranks
columns is the garbage collector's full collections over the growing heap of MetaSteps,
not the passes (``bench_plan.py`` shows the passes alone, with the collector paused). A
last table times the cost-aware policy (``swap_policy="cost"``), which simulates the step
a few times per candidate chunk, each simulation linear in the steps.
``--quick`` drops the two largest growth points (for a fast check).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from ppswap.scheduler.config import ScheduleConfig, ScheduleName
from ppswap.scheduler.cost import CostModel, plan_cost_aware
from ppswap.scheduler.lowering import build_all_orders, build_exec_order
from ppswap.scheduler.simulate import build_timeline, memory_profile
from ppswap.scheduler.steps import Order
from ppswap.scheduler.swap_plan import eligible_chunks

T = TypeVar("T")

FAMILIES: tuple[tuple[str, ScheduleName, int], ...] = (
    ("GPipe", "gpipe", 1),
    ("1F1B", "1f1b", 1),
    ("Interleaved vpp2", "interleaved_1f1b", 2),
    ("Interleaved vpp4", "interleaved_1f1b", 4),
)
PPS = (4, 8, 16, 32, 64)
MICRO_PER_RANK = 2  # micro = 2 * pp: a typical training setup (micro >= pp)
GROWTH_PP = 64
GROWTH_MICROS = (64, 128, 256, 512, 1024)
COST_CASES: tuple[tuple[str, ScheduleConfig], ...] = (
    ("GPipe pp4 m16", ScheduleConfig(schedule="gpipe", pp=4, micro=16, swap=True)),
    ("GPipe pp4 m32", ScheduleConfig(schedule="gpipe", pp=4, micro=32, swap=True)),
    (
        "Interleaved pp8 vpp4 m32",
        ScheduleConfig(schedule="interleaved_1f1b", pp=8, vpp=4, micro=32, swap=True),
    ),
)


def timed(work: Callable[[], T]) -> tuple[float, T]:
    """Wall seconds of ``work()`` with the pre-existing objects frozen for the GC."""
    gc.collect()
    gc.freeze()
    try:
        started = time.perf_counter()
        result = work()
        return time.perf_counter() - started, result
    finally:
        gc.unfreeze()


def peaks_of(orders: tuple[Order, ...]) -> list[tuple[int, int]]:
    """Per rank: peak resident chunks without and with swap."""
    return [
        (max(memory_profile(order, with_swap=False)), max(memory_profile(order)))
        for order in orders
    ]


def measure(name: str, config: ScheduleConfig) -> dict[str, Any]:
    """Plan ``config`` with swap; memory, bubbles and the time of each planning pass."""
    lower_s, orders = timed(partial(build_all_orders, config))
    timeline_s, timeline = timed(partial(build_timeline, config, orders))
    memory_s, peaks = timed(partial(peaks_of, orders))
    one_rank_s, _ = timed(partial(build_exec_order, config, config.pp // 2))
    steps = sum(len(order) for order in orders)
    swapped = sum(len(eligible_chunks(order)) for order in orders)
    row = {
        "name": name,
        "pp": config.pp,
        "vpp": config.vpp,
        "micro": config.micro,
        "steps": steps,
        "swapped_share": swapped / (config.micro * config.num_stages),
        "peak_no_swap": max(p[0] for p in peaks),
        "peak_swap": max(p[1] for p in peaks),
        "bubble_share": max(timeline.bubbles) / timeline.num_columns,
        "lower_s": lower_s,
        "one_rank_s": one_rank_s,
        "timeline_s": timeline_s,
        "memory_s": memory_s,
    }
    del orders, timeline
    gc.collect()
    return row


def config_of(schedule: ScheduleName, pp: int, vpp: int, micro: int) -> ScheduleConfig:
    return ScheduleConfig(schedule=schedule, pp=pp, vpp=vpp, micro=micro, swap=True)


def memory_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| schedule | pp | vpp | micro | swapped chunks | peak chunks no swap | peak chunks swap "
        "| saved | bubble share | plan s | timeline s | memory s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        saved = 1 - r["peak_swap"] / r["peak_no_swap"] if r["peak_no_swap"] else 0.0
        lines.append(
            f"| {r['name']} | {r['pp']} | {r['vpp']} | {r['micro']} | "
            f"{100 * r['swapped_share']:.0f}% | {r['peak_no_swap']} | {r['peak_swap']} | "
            f"{100 * saved:.0f}% | {100 * r['bubble_share']:.1f}% | {r['lower_s']:.2f} | "
            f"{r['timeline_s']:.2f} | {r['memory_s']:.2f} |"
        )
    return "\n".join(lines)


def growth_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| micro | top-level steps | plan s | us / step | one rank s | timeline s | memory s "
        "| peak chunks no swap -> swap |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['micro']} | {r['steps']} | {r['lower_s']:.2f} | "
            f"{1e6 * r['lower_s'] / r['steps']:.1f} | {r['one_rank_s']:.3f} | "
            f"{r['timeline_s']:.2f} | "
            f"{r['memory_s']:.2f} | {r['peak_no_swap']} -> {r['peak_swap']} |"
        )
    return "\n".join(lines)


def cost_rows() -> list[dict[str, Any]]:
    """The cost policy's planning time where its budget binds (copies of 3 leaves, one
    compute thread for all ranks), against the gap rule's lowering of the same schedule."""
    cost = CostModel(
        chunk_bytes=1000,
        d2h_gbps=1000 / 3e9,
        h2d_gbps=1000 / 3e9,
        leaf_s=1.0,
        shared_compute=True,
    )
    rows = []
    for name, config in COST_CASES:
        gap_s, _ = timed(partial(build_all_orders, config))
        plan_s, plan = timed(partial(plan_cost_aware, config, cost))
        rows.append(
            {
                "name": name,
                "gap_s": gap_s,
                "cost_s": plan_s,
                "chunks": sum(len(r.chunks) for r in plan.ranks),
                "candidates": sum(len(r.candidates) for r in plan.ranks),
            }
        )
    return rows


def cost_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| schedule | gap rule: plan s | cost policy: plan s | chunks chosen / fixed rule's |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['name']} | {r['gap_s']:.3f} | {r['cost_s']:.3f} | "
            f"{r['chunks']} / {r['candidates']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="skip micro 512 and 1024")
    parser.add_argument("--json", type=Path, default=None, help="also write the raw rows here")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    memory_rows = [
        measure(name, config_of(schedule, pp, vpp, MICRO_PER_RANK * pp))
        for name, schedule, vpp in FAMILIES
        for pp in PPS
    ]
    micros = GROWTH_MICROS[:-2] if args.quick else GROWTH_MICROS
    growth_rows = [
        measure("Interleaved vpp4", config_of("interleaved_1f1b", GROWTH_PP, 4, micro))
        for micro in micros
    ]
    extremes = (
        []
        if args.quick
        else [
            measure(name, config_of(schedule, GROWTH_PP, vpp, GROWTH_MICROS[-1]))
            for name, schedule, vpp in FAMILIES[:3]
        ]
    )
    costs = cost_rows()
    print(f"Memory and bubbles, micro = {MICRO_PER_RANK} x pp (peaks: the largest rank):\n")
    print(memory_table(memory_rows))
    print(f"\nGrowth in micro: interleaved 1F1B, pp={GROWTH_PP}, vpp=4:\n")
    print(growth_table(growth_rows))
    if extremes:
        print(f"\nThe other families at pp={GROWTH_PP}, micro={GROWTH_MICROS[-1]}:\n")
        print(memory_table(extremes))
    print("\nCost-aware policy (copies of 3 compute leaves, shared compute thread):\n")
    print(cost_table(costs))
    print(f"\n({time.perf_counter() - started:.0f} s)")
    if args.json is not None:
        payload = {
            "memory": memory_rows,
            "growth": growth_rows,
            "extremes": extremes,
            "cost": costs,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
