"""The ``ppswap`` command line: ``ppswap plan``, ``ppswap plot`` and ``ppswap demo``.

``ppswap plan --schedule {gpipe,1f1b,interleaved_1f1b} --pp N [--vpp V] --micro M
[--split-dw] [--overlap-b-f] [--p2p plain|batch|boundary] [--fsdp] [--swap]
[--min-swap-gap N] [--compute-only] [--format text|json]`` prints every rank's order:
the finalized order (compute -> FSDP -> P2P -> swap), or with ``--compute-only`` the
compute slots alone. The orders are validated (per-rank invariants, P2P pairing and the
cross-rank progress simulation) before anything is printed. JSON is
``{"schedule", "pp", "vpp", "micro", "ranks": [{"rank": r, "steps": [MetaStep.to_dict(),
...]}]}``; text is a per-rank grid (``MetaStep.short()`` cells).

A bad configuration prints ``ppswap: error: <message>`` on stderr and exits with 2 (as
argparse does for bad arguments). Each subcommand is a ``run_<name>(args) -> int``
function registered in ``build_parser``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ppswap.demo.fsdp_demo import main_fsdp_demo
from ppswap.demo.run import DemoOptions, main_demo
from ppswap.scheduler.config import (
    DEFAULT_MIN_SWAP_GAP,
    P2P_MODES,
    SCHEDULE_NAMES,
    ScheduleConfig,
)
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.render import format_grid
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.simulate import memory_table
from ppswap.scheduler.steps import Order
from ppswap.scheduler.validate import validate_all, validate_order

try:  # the diagram needs the optional 'plot' extra (matplotlib)
    from ppswap.scheduler.plot import plot_schedule
except ImportError:  # pragma: no cover - depends on the environment
    plot_schedule = None  # type: ignore[assignment]

__all__ = [
    "build_parser",
    "format_json",
    "main",
    "plan_orders",
    "plan_payload",
    "run_demo_command",
    "run_plan",
    "run_plot",
]

PROG = "ppswap"
EXIT_USAGE = 2
_ONE_LINE_WIDTH = 160


def format_json(value: Any, indent: int = 0) -> str:
    """JSON text for people and diffs: a value that fits in one short line stays on one
    line (so each MetaStep is one line), larger lists and objects are split."""
    flat = json.dumps(value)
    if len(flat) <= _ONE_LINE_WIDTH or not isinstance(value, dict | list) or not value:
        return flat
    pad = " " * (indent + 1)
    if isinstance(value, dict):
        items = [
            f"{pad}{json.dumps(key)}: {format_json(item, indent + 1)}"
            for key, item in value.items()
        ]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [f"{pad}{format_json(item, indent + 1)}" for item in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def plan_orders(config: ScheduleConfig, *, compute_only: bool = False) -> tuple[Order, ...]:
    """Every rank's validated order: finalized, or the compute slots alone."""
    if compute_only:
        orders = tuple(compute_order(config, rank) for rank in range(config.pp))
        for rank, order in enumerate(orders):
            validate_order(config, rank, order, lowered=False)
        return orders
    orders = build_all_orders(config)
    validate_all(config, orders)
    return orders


def plan_payload(config: ScheduleConfig, *, compute_only: bool = False) -> dict[str, Any]:
    """The JSON document of ``ppswap plan``; extend it here (e.g. a swap memory table)."""
    orders = plan_orders(config, compute_only=compute_only)
    payload: dict[str, Any] = {
        "schedule": config.schedule,
        "pp": config.pp,
        "vpp": config.vpp,
        "micro": config.micro,
        "ranks": [
            {"rank": rank, "steps": [step.to_dict() for step in order]}
            for rank, order in enumerate(orders)
        ],
    }
    if config.swap:
        payload["memory"] = memory_table(config)
    return payload


def _memory_text(config: ScheduleConfig) -> str:
    rows = memory_table(config)
    lines = [
        f"swap memory model (resident activation chunks, min_swap_gap={config.min_swap_gap}):",
        "rank | eligible | peak no swap | peak swap",
    ]
    lines += [
        f"{r['rank']:>4} | {r['eligible']:>8} | {r['peak_chunks_no_swap']:>12} | "
        f"{r['peak_chunks_swap']:>9}"
        for r in rows
    ]
    return "\n".join(lines)


def _plan_text(config: ScheduleConfig, orders: Sequence[Order], compute_only: bool) -> str:
    options = [
        name
        for name, enabled in (
            ("split_dw", config.split_dw),
            ("overlap_b_f", config.overlap_b_f),
            ("fsdp", config.fsdp),
            ("swap", config.swap),
        )
        if enabled
    ]
    header = (
        f"schedule={config.schedule} pp={config.pp} vpp={config.vpp} micro={config.micro} "
        f"p2p={config.p2p} options={','.join(options) or 'none'}"
    )
    if config.swap:
        header += f" min_swap_gap={config.min_swap_gap}"
    view = "compute slots only" if compute_only else "finalized orders"
    return f"{header} ({view})\n{format_grid(orders, compact=False)}"


def _config_from_args(args: argparse.Namespace) -> ScheduleConfig:
    return ScheduleConfig(
        schedule=args.schedule,
        pp=args.pp,
        vpp=args.vpp,
        micro=args.micro,
        split_dw=args.split_dw,
        overlap_b_f=args.overlap_b_f,
        p2p=args.p2p,
        fsdp=args.fsdp,
        swap=args.swap,
        min_swap_gap=args.min_swap_gap,
    )


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def run_plan(args: argparse.Namespace) -> int:
    """``ppswap plan``: print the per-rank orders of one schedule."""
    try:
        config = _config_from_args(args)
    except (TypeError, ValueError) as exc:
        return _fail(str(exc))
    if args.format == "json":
        payload = plan_payload(config, compute_only=args.compute_only)
        print(format_json(payload))
    else:
        orders = plan_orders(config, compute_only=args.compute_only)
        print(_plan_text(config, orders, args.compute_only))
        if config.swap and not args.compute_only:
            print()
            print(_memory_text(config))
    return 0


def run_plot(args: argparse.Namespace) -> int:
    """``ppswap plot``: draw the schedule diagram (needs the 'plot' extra: matplotlib)."""
    try:
        config = _config_from_args(args)
    except (TypeError, ValueError) as exc:
        return _fail(str(exc))
    if plot_schedule is None:
        return _fail("ppswap plot needs matplotlib: pip install 'ppswap[plot]'")
    try:
        path = plot_schedule(config, args.output)
    except ValueError as exc:
        return _fail(str(exc))
    print(f"wrote {path}")
    return 0


def run_demo_command(args: argparse.Namespace) -> int:
    """``ppswap demo``: train the LM without, then with swap, and report."""
    try:
        options = DemoOptions(
            schedule=args.schedule,
            pp=args.pp,
            vpp=args.vpp,
            micro=args.micro,
            batch=args.batch,
            steps=args.steps,
            out_dir=Path(args.out),
            plot=not args.no_plot,
            fsdp=args.fsdp,
            transport=args.transport,
        )
    except (TypeError, ValueError) as exc:
        return _fail(str(exc))
    if options.fsdp:
        return main_fsdp_demo(options)
    return main_demo(options)


def _add_schedule_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES)
    plan.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    plan.add_argument("--vpp", type=int, default=1, help="virtual stages per rank")
    plan.add_argument("--micro", type=int, required=True, help="micro-batches")
    plan.add_argument("--split-dw", action="store_true", help="dx/dw split (ZB-H1)")
    plan.add_argument("--overlap-b-f", action="store_true", help="OVERLAP_B_F composites")
    plan.add_argument("--p2p", choices=P2P_MODES, default="plain", help="P2P transport")
    plan.add_argument("--fsdp", action="store_true", help="FSDP unshard/reshard steps")
    plan.add_argument("--swap", action="store_true", help="inject activation swap steps")
    plan.add_argument(
        "--min-swap-gap",
        type=int,
        default=DEFAULT_MIN_SWAP_GAP,
        help=f"smallest FWD->BWD gap that is swapped (default {DEFAULT_MIN_SWAP_GAP})",
    )


def _add_plan_parser(subparsers: Any) -> None:
    plan = subparsers.add_parser(
        "plan",
        help="print the per-rank MetaStep orders of a schedule",
        description="Build, validate and print every rank's order of a pipeline schedule.",
    )
    _add_schedule_arguments(plan)
    plan.add_argument(
        "--compute-only", action="store_true", help="only the compute slots, no lowering"
    )
    plan.add_argument("--format", choices=("text", "json"), default="text")
    plan.set_defaults(handler=run_plan)


def _add_plot_parser(subparsers: Any) -> None:
    plot = subparsers.add_parser(
        "plot",
        help="draw the schedule diagram (PNG or SVG)",
        description="Per-rank lanes on the logical time axis with swap windows (RFC 6.8).",
    )
    _add_schedule_arguments(plot)
    plot.add_argument("-o", "--output", required=True, help="FILE.png or FILE.svg")
    plot.set_defaults(handler=run_plot, swap=True)


def _add_demo_parser(subparsers: Any) -> None:
    demo = subparsers.add_parser(
        "demo",
        help="train a small transformer LM with pp ranks, swap off then on",
        description="The main job: trains, checks swap on/off agree, reports memory.",
    )
    demo.add_argument("--schedule", choices=SCHEDULE_NAMES, default="gpipe")
    demo.add_argument("--pp", type=int, default=4)
    demo.add_argument("--vpp", type=int, default=1)
    demo.add_argument("--micro", type=int, default=8)
    demo.add_argument("--batch", type=int, default=16)
    demo.add_argument("--steps", type=int, default=3)
    demo.add_argument("--out", default="out", help="folder for the trace and diagram")
    demo.add_argument("--no-plot", action="store_true", help="skip the diagram")
    demo.add_argument("--fsdp", action="store_true", help="FSDP over dp=2 replicas")
    demo.add_argument("--transport", choices=("inprocess", "mpi"), default="inprocess")
    demo.set_defaults(handler=run_demo_command)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per subcommand."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Pipeline-parallel activation swap: plans and runs."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_plan_parser(subparsers)
    _add_plot_parser(subparsers)
    _add_demo_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ppswap`` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        status: int = handler(args)
    except BrokenPipeError:
        # The reader went away (``ppswap plan ... | head``): stop quietly, as a filter does.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    return status


if __name__ == "__main__":
    sys.exit(main())
