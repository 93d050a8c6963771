"""The ``ppswap`` command line: ``ppswap plan``, ``ppswap plot``, ``ppswap demo`` and
``ppswap serve``.

Each subcommand is a ``run_<name>(args) -> int`` function with its parser, in a module
of its own: ``ppswap.cli_plan`` (the per-rank orders), ``ppswap.cli_plot`` (the
diagram), ``ppswap.cli_demo`` (train the demo LM), ``ppswap.serve.command`` (the
service); the schedule options plan and plot share are in ``ppswap.cli_schedule``, what
every subcommand shares in ``ppswap.cli_args``. ``--vpp`` defaults to 2 for
``interleaved_1f1b`` (which needs at least 2) and for zbv and dualpipev, and to 1 for
the other schedules (the only value they allow), in every subcommand. ``ppswap demo
[--backend mindspore|torch]`` trains the demo LM written in that framework (default
mindspore). The demo's module is looked up by name (``importlib.import_module``) only to
run it: the command line loads no tensor framework, so ``ppswap plan``, ``ppswap plot``
and a refused demo never import one.

A bad configuration prints ``ppswap: error: <message>`` on stderr and exits with 2 (as
argparse does for bad arguments); ``ppswap demo`` checks all of its options before it
builds or trains anything.
"""

from __future__ import annotations

import argparse
import os
import sys

from ppswap.cli_args import EXIT_USAGE, PROG
from ppswap.cli_demo import add_demo_parser
from ppswap.cli_plan import add_plan_parser, format_json, plan_orders, plan_payload, run_plan
from ppswap.cli_plot import add_plot_parser, run_plot
from ppswap.cli_schedule import CLI_COPY_LEAVES, SAVED_UNTIL_OF_BACKEND, cli_cost_model
from ppswap.serve.command import add_serve_parser

__all__ = [
    "CLI_COPY_LEAVES",
    "SAVED_UNTIL_OF_BACKEND",
    "build_parser",
    "cli_cost_model",
    "format_json",
    "main",
    "plan_orders",
    "plan_payload",
    "run_plan",
    "run_plot",
]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per subcommand."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Pipeline-parallel activation swap: plans and runs."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    add_plan_parser(subparsers)
    add_plot_parser(subparsers)
    add_demo_parser(subparsers)
    add_serve_parser(subparsers)
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
