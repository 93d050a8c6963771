"""``ppswap plot``: the schedule diagram, per-rank lanes on the logical time axis, with the
swap plan only with ``--swap`` (as ``ppswap plan``; the schedule options are
``ppswap.cli_schedule``'s). Needs the 'plot' extra (matplotlib)."""

from __future__ import annotations

import argparse
from typing import Any

from ppswap.cli_args import fail, install_hint
from ppswap.cli_schedule import add_schedule_arguments, config_from_args, cost_model_from_args
from ppswap.scheduler.diagram import load_plotter

__all__ = ["add_plot_parser", "run_plot"]


def run_plot(args: argparse.Namespace) -> int:
    """``ppswap plot``: draw the schedule diagram (needs the 'plot' extra: matplotlib)."""
    try:
        config = config_from_args(args)
        cost_model = cost_model_from_args(args)
    except (TypeError, ValueError) as exc:
        return fail(str(exc))
    plot_schedule = load_plotter()
    if plot_schedule is None:
        return fail(f"ppswap plot needs matplotlib: {install_hint('plot')}")
    try:
        path = plot_schedule(
            config, args.output, swap_policy=args.swap_policy, cost_model=cost_model
        )
    except ValueError as exc:
        return fail(str(exc))
    print(f"wrote {path}")
    return 0


def add_plot_parser(subparsers: Any) -> None:
    """Register ``ppswap plot`` on ``subparsers`` (its handler: ``run_plot``)."""
    plot = subparsers.add_parser(
        "plot",
        help="draw the schedule diagram (PNG or SVG)",
        description="Per-rank lanes on the logical time axis; with --swap, the "
        "swap plan: offload and load windows, and resident chunks with against without swap.",
    )
    add_schedule_arguments(plot)
    plot.add_argument("-o", "--output", required=True, help="FILE.png or FILE.svg")
    plot.set_defaults(handler=run_plot)
