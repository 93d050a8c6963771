"""Print the predicted activation memory of swap, per rank, as markdown tables.

    python benchmarks/memory_model_table.py                          # the tables
    python benchmarks/memory_model_table.py --diagrams docs/diagrams # + the four PNGs

This is the command behind ``docs/memory-model.md``. For each named pp=4, m=8 schedule
the orders are lowered with ``swap=True`` (plain P2P, no FSDP, min_swap_gap 4) and the
memory model of ``ppswap.scheduler.simulate`` gives, per rank, the eligible chunks and the
peak resident activation chunks without and with swap; the global logical timeline gives
the bubble columns. No tensor is allocated: this is the plan's prediction, in chunks.
``--diagrams DIR`` also renders the schedule diagrams. Needs matplotlib (``ppswap[plot]``,
part of ``ppswap[dev]``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.plot import plot_schedule
from ppswap.scheduler.simulate import build_timeline, memory_table

NAMED_CONFIGS: dict[str, ScheduleConfig] = {
    "GPipe pp4 m8": ScheduleConfig(schedule="gpipe", pp=4, micro=8, swap=True),
    "1F1B pp4 m8": ScheduleConfig(schedule="1f1b", pp=4, micro=8, swap=True),
    "Interleaved pp4 vpp2 m8": ScheduleConfig(
        schedule="interleaved_1f1b", pp=4, vpp=2, micro=8, swap=True
    ),
    "overlap pp4 m8 (1F1B + overlap_b_f)": ScheduleConfig(
        schedule="1f1b", pp=4, micro=8, overlap_b_f=True, swap=True
    ),
    "overlap + dx/dw pp4 m8": ScheduleConfig(
        schedule="1f1b", pp=4, micro=8, overlap_b_f=True, split_dw=True, swap=True
    ),
}

DIAGRAMS: dict[str, str] = {
    "gpipe_pp4_m8.png": "GPipe pp4 m8",
    "interleaved_pp4_vpp2_m8.png": "Interleaved pp4 vpp2 m8",
    "overlap_pp4_m8.png": "overlap pp4 m8 (1F1B + overlap_b_f)",
    "overlap_dxdw_pp4_m8.png": "overlap + dx/dw pp4 m8",
}


def _saved(no_swap: int, swap: int) -> str:
    return f"{100 * (no_swap - swap) / no_swap:.0f}%" if no_swap else "-"


def per_rank_table(configs: dict[str, ScheduleConfig]) -> str:
    """One row per (schedule, rank)."""
    lines = [
        "| schedule | rank | eligible chunks | peak no swap | peak swap | saved | bubbles |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, config in configs.items():
        bubbles = build_timeline(config, build_all_orders(config)).bubbles
        for row in memory_table(config):
            no_swap, swap = row["peak_chunks_no_swap"], row["peak_chunks_swap"]
            lines.append(
                f"| {name} | {row['rank']} | {row['eligible']} | {no_swap} | {swap} | "
                f"{_saved(no_swap, swap)} | {bubbles[row['rank']]} |"
            )
    return "\n".join(lines)


def summary_table(configs: dict[str, ScheduleConfig]) -> str:
    """One row per schedule: the largest rank peak (what sizes the device), both ways."""
    lines = [
        "| schedule | chunks / rank | eligible (all ranks) | max peak no swap | "
        "max peak swap | saved |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, config in configs.items():
        rows = memory_table(config)
        no_swap = max(r["peak_chunks_no_swap"] for r in rows)
        swap = max(r["peak_chunks_swap"] for r in rows)
        eligible = sum(r["eligible"] for r in rows)
        chunks = config.micro * config.vpp
        lines.append(
            f"| {name} | {chunks} | {eligible} | {no_swap} | {swap} | {_saved(no_swap, swap)} |"
        )
    return "\n".join(lines)


def render_diagrams(directory: Path) -> list[Path]:
    """Render the four committed diagrams into ``directory``."""
    return [plot_schedule(NAMED_CONFIGS[name], directory / file) for file, name in DIAGRAMS.items()]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--diagrams", type=Path, default=None, help="also render the PNG diagrams into DIR"
    )
    args = parser.parse_args(argv)
    print("Peak resident activation chunks, largest rank:\n")
    print(summary_table(NAMED_CONFIGS))
    print("\nPer rank:\n")
    print(per_rank_table(NAMED_CONFIGS))
    if args.diagrams is not None:
        for path in render_diagrams(args.diagrams):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
