"""Planner time: ppswap's lowering beside torch.distributed.pipelining's compute order.

    python benchmarks/bench_plan.py [--repeats N] [--json PATH]

Two schedules, each with pp=32 and 256 micro-batches: interleaved 1F1B with vpp=4, and ZBV
(zero bubble in a V, vpp=2: rank ``r`` holds stages ``r`` and ``63 - r``). What is timed,
for each (the interleaved names below; ZBV's are ``ScheduleZBVZeroBubble`` and its rank
0's two stand-in stages):

ppswap
    ``lowering.build_all_orders`` for all 32 ranks with FSDP, ``p2p="batch"`` and swap:
    compute order, FSDP unshard/reshard steps, P2P steps fused into batches and the four
    swap steps of every eligible chunk (about 391k top-level MetaSteps). The row without
    swap is the same lowering with ``swap=False``.
torch, compute order only
    ``torch.distributed.pipelining.schedules.ScheduleInterleaved1F1B`` fills its
    ``pipeline_order`` (every rank's list of forward/backward actions and empty slots,
    about 70k entries) in its constructor with the loop
    ``for rank in range(pp_group_size): _calculate_single_rank_operations(rank)``. The
    schedule is built once with stand-in stage objects (only ``stage_index``,
    ``num_stages``, ``group_size`` and ``group_rank`` are read; no process group is needed)
    and that same loop is timed on it: torch's own code, nothing else.
torch, whole constructor
    For reference: the compute order plus torch's own lowering of it for every rank
    (unshard/reshard, reduce-grad and send/recv actions), the counterpart of ppswap's
    lowering without swap.

Both sides are measured alike: each run starts with ``gc.collect()`` and ``gc.freeze()``,
so objects alive before it (imports, earlier results) are not rescanned by the collector
and the figure is the code's own, whatever the process imported; the collector still runs
on what the run allocates. Wall time, best and median of ``--repeats`` runs, the sides
alternating; the headline also gives the best CPU time (steadier on a shared machine).
The target is ppswap (with swap) / torch <= 0.5, against torch's whole constructor: that
is the schedule torch builds before a step can run (about 1 s here, the "compute order"
figure the target was set against), and the counterpart of ppswap's lowering. Against the
compute-order loop alone (about 0.05 s: 70k tuples where ppswap builds 391k typed steps
with their swap, FSDP and P2P steps) ppswap is several times slower, and the line says so.
torch is an optional dependency: without it only ppswap's rows are printed.

Then: the growth of both in the number of micro-batches (linear when the time ratio over
the micro ratio stays near 1; CPU times, steadier than wall times on a shared machine).
ppswap's passes are linear; with the collector running, its full collections rescan the
growing heap of MetaSteps (which holds no cycles to free), so the time per step grows
with micro: the column with the collector paused shows the passes alone. Last, the
planning time of the cost-aware swap policy (``swap_policy="cost"``) on GPipe pp4 with
copies of 3 compute leaves on a compute thread shared by the ranks, where the budget
binds. ``--json PATH`` writes the raw numbers.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar, cast

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import CostModel, plan_cost_aware
from ppswap.scheduler.lowering import build_all_orders

torch_schedules: ModuleType | None
try:
    import torch.distributed.pipelining.schedules as torch_schedules
except ImportError:  # torch is an optional benchmark dependency
    torch_schedules = None

PP = 32
VPP = 4
HEADLINE_MICRO = 256
GROWTH_MICROS = (64, 128, 256, 512)
TARGET_RATIO = 0.5
COST_MICROS = (8, 16, 32, 64)
COST_MODEL = CostModel(
    chunk_bytes=1000, d2h_gbps=1000 / 3e9, h2d_gbps=1000 / 3e9, leaf_s=1.0, shared_compute=True
)

_Result = TypeVar("_Result")


def lowering_config(micro: int, *, swap: bool = True) -> ScheduleConfig:
    return ScheduleConfig(
        schedule="interleaved_1f1b",
        pp=PP,
        vpp=VPP,
        micro=micro,
        fsdp=True,
        p2p="batch",
        swap=swap,
    )


def timed(work: Callable[[], _Result], *, collector: bool = True) -> tuple[float, float, _Result]:
    """Wall and CPU seconds of ``work()`` and its result, the objects alive before it
    frozen for the collector; with ``collector=False`` the collector is paused for the run."""
    gc.collect()
    gc.freeze()
    if not collector:
        gc.disable()
    try:
        started, cpu_started = time.perf_counter(), time.process_time()
        result = work()
        return time.perf_counter() - started, time.process_time() - cpu_started, result
    finally:
        gc.enable()
        gc.unfreeze()


@dataclass
class StandInStage:
    """The attributes torch's multi-stage schedules read from a pipeline stage to build
    their orders (``stage_index_to_group_rank`` is written by the constructor; ``submod``
    is read by the zero-bubble schedules' torch.compile check, which skips a non-module)."""

    stage_index: int
    num_stages: int
    group_size: int
    group_rank: int
    stage_index_to_group_rank: dict[int, int] | None = None
    submod: Any = None


def torch_schedule(micro: int) -> Any:
    """torch's ScheduleInterleaved1F1B for rank 0 of pp x vpp stages (built once)."""
    assert torch_schedules is not None
    stages = [StandInStage(v * PP, PP * VPP, PP, 0) for v in range(VPP)]
    return torch_schedules.ScheduleInterleaved1F1B(cast(Any, stages), micro)


def zbv_config(micro: int, *, swap: bool = True) -> ScheduleConfig:
    return ScheduleConfig(
        schedule="zbv", pp=PP, vpp=2, micro=micro, fsdp=True, p2p="batch", swap=swap
    )


def torch_zbv_schedule(micro: int) -> Any:
    """torch's ScheduleZBVZeroBubble for rank 0 (stages 0 and 2 * pp - 1, the V's ends)."""
    assert torch_schedules is not None
    num_stages = 2 * PP
    stages = [StandInStage(index, num_stages, PP, 0) for index in (0, num_stages - 1)]
    return torch_schedules.ScheduleZBVZeroBubble(cast(Any, stages), micro)


@dataclass(frozen=True)
class HeadlineSchedule:
    """One schedule of the headline: ppswap's config and torch's class for a micro."""

    name: str
    torch_class: str
    config: Callable[..., ScheduleConfig]
    build_torch: Callable[[int], Any]


INTERLEAVED = HeadlineSchedule(
    f"interleaved pp{PP} vpp{VPP}", "ScheduleInterleaved1F1B", lowering_config, torch_schedule
)
ZBV = HeadlineSchedule(f"ZBV pp{PP}", "ScheduleZBVZeroBubble", zbv_config, torch_zbv_schedule)


def torch_compute_orders(schedule: Any) -> dict[int, list[Any]]:
    """The constructor's own loop that fills ``pipeline_order`` for every rank."""
    return {
        rank: schedule._calculate_single_rank_operations(rank)
        for rank in range(schedule.pp_group_size)
    }


@dataclass
class Samples:
    """Wall times (and CPU times) of one measurement, and the size of what it built."""

    seconds: list[float]
    entries: int = 0
    cpu_seconds: list[float] = field(default_factory=list)

    def add(self, wall: float, cpu: float) -> None:
        self.seconds.append(wall)
        self.cpu_seconds.append(cpu)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def best_cpu(self) -> float:
        return min(self.cpu_seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def measure_headline(repeats: int, family: HeadlineSchedule = INTERLEAVED) -> dict[str, Samples]:
    """Every row of the headline table, ``repeats`` runs each, the rows alternating."""
    rows = {"ppswap": Samples([]), "ppswap_no_swap": Samples([])}
    schedule = None
    if torch_schedules is not None:
        schedule = family.build_torch(HEADLINE_MICRO)
        rows["torch_compute"] = Samples([])
        rows["torch_constructor"] = Samples([])
    for _ in range(repeats):
        for key, swap in (("ppswap", True), ("ppswap_no_swap", False)):
            config = family.config(HEADLINE_MICRO, swap=swap)
            wall, cpu, orders = timed(partial(build_all_orders, config))
            rows[key].add(wall, cpu)
            rows[key].entries = sum(len(order) for order in orders)
            del orders
        if schedule is not None:
            wall, cpu, actions = timed(partial(torch_compute_orders, schedule))
            rows["torch_compute"].add(wall, cpu)
            rows["torch_compute"].entries = sum(len(ops) for ops in actions.values())
            del actions
            wall, cpu, built = timed(partial(family.build_torch, HEADLINE_MICRO))
            rows["torch_constructor"].add(wall, cpu)
            rows["torch_constructor"].entries = sum(
                len(ops) for ops in built.pipeline_order_with_comms.values()
            )
            del built
    return rows


HEADLINE_LABELS = {
    "ppswap": "ppswap `build_all_orders`: FSDP, batch P2P, swap",
    "ppswap_no_swap": "ppswap `build_all_orders`: FSDP, batch P2P, no swap",
    "torch_compute": "torch `{cls}`: compute order (`pipeline_order`)",
    "torch_constructor": "torch `{cls}` constructor: compute order + comms",
}


def headline_table(rows: dict[str, Samples], family: HeadlineSchedule = INTERLEAVED) -> str:
    lines = [
        f"| all {PP} ranks, {family.name} m{HEADLINE_MICRO} | entries built "
        "| best s | median s | CPU s, best |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, samples in rows.items():
        label = HEADLINE_LABELS[key].format(cls=family.torch_class)
        lines.append(
            f"| {label} | {samples.entries} | {samples.best:.3f} | "
            f"{samples.median:.3f} | {samples.best_cpu:.3f} |"
        )
    return "\n".join(lines)


def ratios(rows: dict[str, Samples]) -> dict[str, float | None]:
    """ppswap with swap over torch's constructor (wall and CPU) and its compute loop."""
    if "torch_compute" not in rows:
        return {"to_constructor": None, "to_constructor_cpu": None, "to_compute": None}
    ours = rows["ppswap"]
    return {
        "to_constructor": ours.best / rows["torch_constructor"].best,
        "to_constructor_cpu": ours.best_cpu / rows["torch_constructor"].best_cpu,
        "to_compute": ours.best / rows["torch_compute"].best,
    }


def ratio_line(rows: dict[str, Samples], family: HeadlineSchedule) -> str:
    found = ratios(rows)
    to_constructor, to_compute = found["to_constructor"], found["to_compute"]
    if to_constructor is None or to_compute is None:
        return "torch is not installed: no comparison (pip install torch to get one)"
    verdict = "met" if to_constructor <= TARGET_RATIO else "not met"
    return (
        f"ppswap (with swap) / torch's {family.torch_class} constructor: {to_constructor:.2f} "
        f"wall, {found['to_constructor_cpu']:.2f} CPU (target <= {TARGET_RATIO}: {verdict}); "
        f"/ torch's compute-order loop alone: {to_compute:.2f} (not a target ppswap meets)"
    )


def measure_growth(repeats: int) -> list[dict[str, Any]]:
    """ppswap's lowering (with swap; also with the collector paused) and torch's compute
    order at each growth micro."""
    rows = []
    for micro in GROWTH_MICROS:
        config = lowering_config(micro)
        ours = Samples([])
        paused = Samples([])
        theirs = Samples([])
        schedule = torch_schedule(micro) if torch_schedules is not None else None
        for _ in range(repeats):
            wall, cpu, orders = timed(partial(build_all_orders, config))
            ours.add(wall, cpu)
            ours.entries = sum(len(order) for order in orders)
            del orders
            wall, cpu, _ = timed(partial(build_all_orders, config), collector=False)
            paused.add(wall, cpu)
            if schedule is not None:
                wall, cpu, _ = timed(partial(torch_compute_orders, schedule))
                theirs.add(wall, cpu)
        rows.append(
            {
                "micro": micro,
                "steps": ours.entries,
                "ppswap_s": ours.best_cpu,
                "ppswap_paused_s": paused.best_cpu,
                "torch_compute_s": theirs.best_cpu if theirs.seconds else None,
            }
        )
    return rows


def growth_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| micro | ppswap top-level steps | ppswap CPU s | ppswap CPU s, collector paused "
        "| torch compute order CPU s | ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        torch_s = row["torch_compute_s"]
        theirs = "-" if torch_s is None else f"{torch_s:.3f}"
        ratio = "-" if torch_s is None else f"{row['ppswap_s'] / torch_s:.1f}"
        lines.append(
            f"| {row['micro']} | {row['steps']} | {row['ppswap_s']:.3f} | "
            f"{row['ppswap_paused_s']:.3f} | {theirs} | {ratio} |"
        )
    return "\n".join(lines)


def linearity(rows: list[dict[str, Any]], key: str) -> float:
    """Time ratio over micro ratio from the first growth point to the last (1.00: linear)."""
    first, last = rows[0], rows[-1]
    return float((last[key] / first[key]) / (last["micro"] / first["micro"]))


def measure_cost_policy(repeats: int) -> list[dict[str, Any]]:
    """plan_cost_aware on GPipe pp4 at each of COST_MICROS (best of up to 3 runs)."""
    rows = []
    for micro in COST_MICROS:
        config = ScheduleConfig(schedule="gpipe", pp=4, micro=micro, swap=True)
        seconds = []
        for _ in range(min(repeats, 3)):
            elapsed, _, plan = timed(partial(plan_cost_aware, config, COST_MODEL))
            seconds.append(elapsed)
        rows.append(
            {
                "micro": micro,
                "plan_s": min(seconds),
                "chunks": len(plan.chunks),
                "candidates": sum(len(rank.candidates) for rank in plan.ranks),
                "peaks": [rank.peak_chunks for rank in plan.ranks],
                "peaks_gap": [rank.peak_chunks_gap for rank in plan.ranks],
            }
        )
    return rows


def cost_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| GPipe pp4 | plan s | chunks chosen / fixed rule's | peak chunks per rank (fixed rule) |",
        "|---|---:|---:|---|",
    ]
    for row in rows:
        peaks = " ".join(str(p) for p in row["peaks"])
        gap = " ".join(str(p) for p in row["peaks_gap"])
        lines.append(
            f"| m{row['micro']} | {row['plan_s']:.3f} | {row['chunks']} / {row['candidates']} | "
            f"{peaks} ({gap}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None, help="write raw numbers here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")

    print(f"Lowering every rank, best and median of {args.repeats} runs:")
    headlines: dict[str, dict[str, Any]] = {}
    for family in (INTERLEAVED, ZBV):
        headline = measure_headline(args.repeats, family)
        print(f"\n{headline_table(headline, family)}\n")
        print(ratio_line(headline, family))
        headlines[family.name] = {
            "rows": {key: vars(samples) for key, samples in headline.items()},
            **ratios(headline),
        }

    growth = measure_growth(args.repeats)
    print(f"\nGrowth in micro (pp={PP}, vpp={VPP}, FSDP, batch P2P, swap), best CPU times:\n")
    print(growth_table(growth))
    print(
        f"\nTime ratio / micro ratio from micro={growth[0]['micro']} to "
        f"{growth[-1]['micro']} (1.00 = linear): ppswap {linearity(growth, 'ppswap_s'):.2f}, "
        f"with the collector paused {linearity(growth, 'ppswap_paused_s'):.2f}"
    )
    if growth[0]["torch_compute_s"] is not None:
        print(f"torch compute order: {linearity(growth, 'torch_compute_s'):.2f}")

    costs = measure_cost_policy(args.repeats)
    print(
        '\nCost-aware policy (`swap_policy="cost"`), copies of 3 compute leaves, one compute '
        "thread for all ranks (the budget binds):\n"
    )
    print(cost_table(costs))
    if args.json is not None:
        payload = {
            "headline": headlines,
            "growth": growth,
            "cost_policy": costs,
        }
        args.json.write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
