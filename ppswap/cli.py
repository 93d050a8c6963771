"""The ``ppswap`` command line: ``ppswap plan``, ``ppswap plot`` and ``ppswap demo``.

``ppswap plan --schedule SCHEDULE --pp N [--vpp V] --micro M
[--split-dw] [--overlap-b-f] [--p2p plain|batch|boundary] [--fsdp] [--swap] [--min-swap-gap N]
[--swap-policy gap|peak|cost [--copy-leaves X] [--cost-budget B]] [--backend mindspore|torch]
[--compute-only]
[--format text|json|torch-csv] [--width N]`` prints every rank's order: the finalized order (compute
-> FSDP -> P2P -> swap, the swapped chunks those of ``--swap-policy``), or with
``--compute-only`` the compute slots alone. The orders are validated (per-rank invariants,
P2P pairing and the cross-rank progress simulation) before anything is printed. JSON is
``{"schedule", "pp", "vpp", "micro", "ranks": [{"rank": r, "steps": [MetaStep.to_dict(),
...]}]}``, with ``--swap`` also ``"swap_policy"`` and ``"memory"`` (the memory model's rows
per rank, ``simulate.memory_rows``); torch-csv is the compute orders as the CSV
torch.distributed.pipelining writes and loads (``user_orders.csv_text``: one row per
rank, one action per cell, ``0F0``); text is a per-rank grid (``MetaStep.short()`` cells)
folded into blocks of at most ``--width`` columns, then a legend of every step code in it
and, with ``--swap``, the memory model's table. ``--backend`` (default mindspore) says where
the memory model frees a chunk whose backward is split (``ScheduleConfig.saved_until``).

``ppswap plot`` takes the same schedule and swap options and draws the diagram, with the
swap plan only with ``--swap`` (as ``plan``). ``--swap-policy cost`` plans with
``cli_cost_model``: a chunk's copy each way takes ``--copy-leaves`` compute leaves
(default 1) and the predicted exposed wait may use ``--cost-budget`` of the step (default
``DEFAULT_COST_BUDGET``, 2%). ``--vpp`` defaults to 2 for ``interleaved_1f1b`` (which
needs at least 2) and to 1 for the other schedules (the only value they allow), in every
subcommand. ``ppswap demo [--backend mindspore|torch]`` trains the demo LM written in that
framework (default mindspore). The demo's module is looked up by name
(``importlib.import_module``) only to run it: this module loads no tensor framework, so
``ppswap plan``, ``ppswap plot`` and a refused demo never import one.

A bad configuration prints ``ppswap: error: <message>`` on stderr and exits with 2 (as
argparse does for bad arguments); ``ppswap demo`` checks all of its options before it
builds or trains anything. Each subcommand is a ``run_<name>(args) -> int`` function
registered in ``build_parser``; the demo's options and run are in ``ppswap.cli_demo``,
what the subcommands share in ``ppswap.cli_args``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from ppswap.cli_args import EXIT_USAGE, PROG, VPP_HELP, fail, install_hint, vpp_of
from ppswap.cli_budget import budget_plan, budget_text
from ppswap.cli_demo import add_demo_parser
from ppswap.scheduler.config import (
    DEFAULT_MIN_SWAP_GAP,
    P2P_MODES,
    SCHEDULE_NAMES,
    SavedUntil,
    ScheduleConfig,
)
from ppswap.scheduler.cost import (
    DEFAULT_COST_BUDGET,
    SWAP_POLICIES,
    CostModel,
    SwapPolicy,
    build_orders,
)
from ppswap.scheduler.diagram import load_plotter
from ppswap.scheduler.recompute_plan import inject_recompute_steps, recomputed_chunks
from ppswap.scheduler.render import format_grid, step_legend
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.simulate import memory_rows
from ppswap.scheduler.steps import Order
from ppswap.scheduler.ties import check_tie_groups, with_tie_steps
from ppswap.scheduler.user_orders import csv_text
from ppswap.scheduler.validate import validate_all, validate_order
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

TEXT_WIDTH = 100
"""The default ``--width`` of ``ppswap plan``'s text: no line of it is longer."""
MIN_TEXT_WIDTH = 50
"""The smallest ``--width`` other than 0: the memory table's rows are 42 characters."""
_ONE_LINE_WIDTH = 160
CLI_COPY_LEAVES = 1.0
"""``--copy-leaves``' default: one chunk's copy each way takes one compute leaf."""
_CLI_CHUNK_BYTES = 1000
_CLI_LEAF_S = 1.0
SAVED_UNTIL_OF_BACKEND: dict[str, SavedUntil] = {"mindspore": "input", "torch": "weight"}
"""``--backend``: each framework's ``Backend.saved_until``, without importing it."""


def cli_cost_model(copy_leaves: float, budget: float) -> CostModel:
    """The cost policy's model on the command line, in units of a compute leaf: every leaf
    takes 1 s, every chunk moves 1000 bytes each way in ``copy_leaves`` leaves, and the
    predicted exposed wait may use ``budget`` of the step (one device per rank).

    ValueError naming the option unless ``copy_leaves`` is a finite number > 0 and
    ``budget`` one in [0, 1].
    """
    if not 0 < copy_leaves < float("inf"):
        raise ValueError(f"copy_leaves must be a finite number > 0, got {copy_leaves!r}")
    if not 0 <= budget <= 1:
        raise ValueError(f"cost_budget must be a number in [0, 1], got {budget!r}")
    gbps = _CLI_CHUNK_BYTES / (copy_leaves * _CLI_LEAF_S) / 1e9
    return CostModel(
        chunk_bytes=_CLI_CHUNK_BYTES,
        d2h_gbps=gbps,
        h2d_gbps=gbps,
        leaf_s=_CLI_LEAF_S,
        budget=budget,
    )


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


def plan_orders(
    config: ScheduleConfig,
    *,
    compute_only: bool = False,
    swap_policy: SwapPolicy = "gap",
    cost_model: CostModel | None = None,
    ties: Sequence[Sequence[int]] = (),
    recompute: bool = False,
) -> tuple[Order, ...]:
    """Every rank's validated order: finalized (its swapped chunks ``swap_policy``'s, with
    ``cost_model`` for ``"cost"``; a TIED_GRAD_SUM last per tie in ``ties``, each the
    stages holding one tied parameter; with ``recompute`` a RECOMPUTE step for every
    chunk, as ``recompute=True`` where every stage has a recompute-wrapped block), or the
    compute slots alone."""
    if compute_only:
        orders = tuple(compute_order(config, rank) for rank in range(config.pp))
        for rank, order in enumerate(orders):
            validate_order(config, rank, order, lowered=False)
        return orders
    orders = build_orders(config, swap_policy, cost_model)
    if recompute:
        chunks = recomputed_chunks(config, range(config.num_stages))
        orders = tuple(
            inject_recompute_steps(order, config, rank, chunks) for rank, order in enumerate(orders)
        )
    validate_all(config, orders)
    return with_tie_steps(config, orders, ties) if ties else orders


def plan_payload(
    config: ScheduleConfig,
    *,
    compute_only: bool = False,
    swap_policy: SwapPolicy = "gap",
    cost_model: CostModel | None = None,
    ties: Sequence[Sequence[int]] = (),
    recompute: bool = False,
) -> dict[str, Any]:
    """The JSON document of ``ppswap plan``; extend it here."""
    orders = plan_orders(
        config,
        compute_only=compute_only,
        swap_policy=swap_policy,
        cost_model=cost_model,
        ties=ties,
        recompute=recompute,
    )
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
        payload["swap_policy"] = swap_policy
        planned = (
            orders
            if not compute_only
            else plan_orders(config, swap_policy=swap_policy, cost_model=cost_model)
        )
        payload["memory"] = memory_rows(planned, saved_until=config.saved_until)
    return payload


def _memory_text(config: ScheduleConfig, orders: Sequence[Order], width: int) -> str:
    """The swap memory model of ``orders`` per rank, as a table; its title wrapped at
    ``width``."""
    rows = memory_rows(orders, saved_until=config.saved_until)
    title = f"swap memory model (resident activation chunks, min_swap_gap={config.min_swap_gap}):"
    lines = [*textwrap.wrap(title, width), "rank |  swapped | peak no swap | peak swap"]
    lines += [
        f"{r['rank']:>4} | {r['eligible']:>8} | {r['peak_chunks_no_swap']:>12} | "
        f"{r['peak_chunks_swap']:>9}"
        for r in rows
    ]
    return "\n".join(lines)


def _plan_text(
    config: ScheduleConfig,
    orders: Sequence[Order],
    compute_only: bool,
    width: int | None,
    swap_policy: SwapPolicy,
    cost_model: CostModel | None,
) -> str:
    """The header, the grid (folded at ``width``; ``None``: one line per rank), the legend."""
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
        header += f" min_swap_gap={config.min_swap_gap} swap_policy={swap_policy}"
        if cost_model is not None:
            copy_leaves = _CLI_CHUNK_BYTES / (cost_model.d2h_gbps * 1e9 * cost_model.leaf_s)
            header += f" copy_leaves={copy_leaves:g} cost_budget={cost_model.budget:g}"
    view = "compute slots only" if compute_only else "finalized orders"
    title = f"{header} ({view})"
    lines = textwrap.wrap(title, width, subsequent_indent="  ") if width else [title]
    lines.append(format_grid(orders, compact=False, width=width))
    lines += ["", step_legend(orders, width=width or TEXT_WIDTH)]
    return "\n".join(lines)


def _cost_model_from_args(args: argparse.Namespace) -> CostModel | None:
    """``cli_cost_model`` of ``--copy-leaves`` and ``--cost-budget`` with ``--swap-policy
    cost``, else None; ValueError when either is given with another policy."""
    if args.swap_policy != "cost":
        for option, value in (("copy_leaves", args.copy_leaves), ("cost_budget", args.cost_budget)):
            if value is not None:
                raise ValueError(
                    f"{option} is only used with swap_policy 'cost', got {option}={value!r} "
                    f"with swap_policy {args.swap_policy!r}"
                )
        return None
    return cli_cost_model(
        CLI_COPY_LEAVES if args.copy_leaves is None else args.copy_leaves,
        DEFAULT_COST_BUDGET if args.cost_budget is None else args.cost_budget,
    )


def _config_from_args(args: argparse.Namespace) -> ScheduleConfig:
    return ScheduleConfig(
        schedule=args.schedule,
        pp=args.pp,
        vpp=vpp_of(args),
        micro=args.micro,
        split_dw=args.split_dw,
        overlap_b_f=args.overlap_b_f,
        p2p=args.p2p,
        fsdp=args.fsdp,
        swap=args.swap,
        min_swap_gap=args.min_swap_gap,
        saved_until=SAVED_UNTIL_OF_BACKEND[args.backend],
    )


def run_plan(args: argparse.Namespace) -> int:
    """``ppswap plan``: print the per-rank orders of one schedule."""
    try:
        config = _config_from_args(args)
        cost_model = _cost_model_from_args(args)
        check_tie_groups(config, args.tie)
        if args.width != 0 and args.width < MIN_TEXT_WIDTH:
            raise ValueError(
                f"width must be 0 (one line per rank) or an int >= {MIN_TEXT_WIDTH}, "
                f"got {args.width}"
            )
    except (TypeError, ValueError) as exc:
        return fail(str(exc))
    policy: SwapPolicy = args.swap_policy
    if args.memory_budget is not None:
        try:
            plan = budget_plan(
                config,
                cost_model or cli_cost_model(CLI_COPY_LEAVES, DEFAULT_COST_BUDGET),
                budget_chunks=args.memory_budget,
                recompute=args.recompute,
                recompute_share=args.recompute_share,
            )
        except (TypeError, ValueError) as exc:
            return fail(str(exc))
        print(budget_text(plan))
        return 0
    chosen = {"compute_only": args.compute_only, "swap_policy": policy, "cost_model": cost_model}
    chosen["ties"] = args.tie
    chosen["recompute"] = args.recompute
    if args.format == "json":
        print(format_json(plan_payload(config, **chosen)))
    elif args.format == "torch-csv":
        # compute slots only: the CSV torch's schedules write and load (compute_only)
        print(csv_text(plan_orders(config, compute_only=True)), end="")
    else:
        orders = plan_orders(config, **chosen)
        width = args.width or None
        print(_plan_text(config, orders, args.compute_only, width, policy, cost_model))
        if config.swap and not args.compute_only:
            print()
            print(_memory_text(config, orders, args.width or TEXT_WIDTH))
    return 0


def run_plot(args: argparse.Namespace) -> int:
    """``ppswap plot``: draw the schedule diagram (needs the 'plot' extra: matplotlib)."""
    try:
        config = _config_from_args(args)
        cost_model = _cost_model_from_args(args)
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


def _add_schedule_arguments(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--schedule", required=True, choices=SCHEDULE_NAMES, help="schedule family")
    plan.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    plan.add_argument("--vpp", type=int, default=None, help=VPP_HELP)
    plan.add_argument("--micro", type=int, required=True, help="micro-batches")
    plan.add_argument("--split-dw", action="store_true", help="dx/dw split (ZB-H1)")
    plan.add_argument("--overlap-b-f", action="store_true", help="OVERLAP_B_F composites")
    plan.add_argument("--p2p", choices=P2P_MODES, default="plain", help="P2P transport")
    plan.add_argument("--fsdp", action="store_true", help="FSDP unshard/reshard steps")
    plan.add_argument(
        "--swap", action="store_true", help="inject the activation swap steps (default: off)"
    )
    plan.add_argument(
        "--min-swap-gap",
        type=int,
        default=DEFAULT_MIN_SWAP_GAP,
        help=f"smallest FWD->BWD gap that is swapped (default {DEFAULT_MIN_SWAP_GAP})",
    )
    plan.add_argument(
        "--backend",
        choices=tuple(SAVED_UNTIL_OF_BACKEND),
        default="mindspore",
        help="the framework whose memory the model predicts: with a dx/dw split, mindspore "
        "frees a chunk at its BWD_INPUT, torch at its BWD_WEIGHT (default mindspore)",
    )
    plan.add_argument(
        "--swap-policy",
        choices=SWAP_POLICIES,
        default="gap",
        help="with --swap, which chunks move: gap, every chunk the gap rule admits (the "
        "default); peak, the fewest of those that give the same peak; cost, those whose "
        "predicted copy wait fits --cost-budget (docs/swap.md)",
    )
    plan.add_argument(
        "--copy-leaves",
        type=float,
        default=None,
        help=f"with --swap-policy cost: how many compute leaves one chunk's copy takes each "
        f"way (default {CLI_COPY_LEAVES:g})",
    )
    plan.add_argument(
        "--cost-budget",
        type=float,
        default=None,
        help=f"with --swap-policy cost: the share of the step the predicted copy wait may "
        f"take, in [0, 1] (default {DEFAULT_COST_BUDGET:g})",
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
    plan.add_argument(
        "--recompute",
        action="store_true",
        help="a RECOMPUTE step (R) before every chunk's backward, as recompute=True where "
        "every stage has a recompute_wrapper block",
    )
    plan.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        help="plan keep/swap/recompute per chunk within this many chunks per rank and print "
        "the per-chunk policy (swap with --swap, recompute with --recompute)",
    )
    plan.add_argument(
        "--recompute-share",
        type=float,
        default=0.25,
        help="with --memory-budget: the share of a chunk a recomputed chunk keeps until its "
        "RECOMPUTE (default 0.25)",
    )
    plan.add_argument(
        "--format",
        choices=("text", "json", "torch-csv"),
        default="text",
        help="text: a grid of step codes and their legend; json: every step; torch-csv: "
        "the compute orders as the CSV torch.distributed.pipelining writes and loads, one "
        "row per rank (default text)",
    )
    plan.add_argument(
        "--width",
        type=int,
        default=TEXT_WIDTH,
        help=f"fold the text grid into blocks at most this many columns wide; 0: one line "
        f"per rank (default {TEXT_WIDTH})",
    )
    plan.add_argument(
        "--tie",
        action="append",
        default=[],
        type=lambda text: tuple(int(part) for part in text.split(",")),
        metavar="S,S[,S...]",
        help="stages holding one tied parameter (e.g. 0,3: a head tied to the embedding): "
        "each holder rank's order ends with its TIED_GRAD_SUM; repeatable",
    )
    plan.set_defaults(handler=run_plan)


def _add_plot_parser(subparsers: Any) -> None:
    plot = subparsers.add_parser(
        "plot",
        help="draw the schedule diagram (PNG or SVG)",
        description="Per-rank lanes on the logical time axis; with --swap, the "
        "swap plan: offload and load windows, and resident chunks with against without swap.",
    )
    _add_schedule_arguments(plot)
    plot.add_argument("-o", "--output", required=True, help="FILE.png or FILE.svg")
    plot.set_defaults(handler=run_plot)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with one sub-parser per subcommand."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Pipeline-parallel activation swap: plans and runs."
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_plan_parser(subparsers)
    _add_plot_parser(subparsers)
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
