"""``ppswap plan``: every rank's order of one schedule, validated, as text, JSON or torch's CSV.

``ppswap plan --schedule SCHEDULE --pp N [--vpp V] --micro M
[--split-dw] [--overlap-b-f] [--p2p plain|batch|boundary] [--fsdp] [--swap] [--min-swap-gap N]
[--swap-policy gap|peak|cost [--copy-leaves X] [--cost-budget B]] [--backend mindspore|torch]
[--compute-only] [--recompute] [--tie S,S ...] [--memory-budget C [--recompute-share R]]
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
and, with ``--swap``, the memory model's table. With ``--memory-budget`` it prints the
per-chunk keep / swap / recompute plan instead (``ppswap.cli_budget``). The schedule
options are ``ppswap.cli_schedule``'s.
"""

from __future__ import annotations

import argparse
import json
import textwrap
from collections.abc import Sequence
from typing import Any

from ppswap.cli_args import fail
from ppswap.cli_budget import budget_plan, budget_text
from ppswap.cli_schedule import (
    CLI_COPY_LEAVES,
    add_schedule_arguments,
    cli_cost_model,
    config_from_args,
    copy_leaves_of,
    cost_model_from_args,
)
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import DEFAULT_COST_BUDGET, CostModel, SwapPolicy, build_orders
from ppswap.scheduler.recompute_plan import inject_recompute_steps, recomputed_chunks
from ppswap.scheduler.render import format_grid, step_legend
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.simulate import memory_rows
from ppswap.scheduler.steps import Order
from ppswap.scheduler.ties import check_tie_groups, with_tie_steps
from ppswap.scheduler.user_orders import csv_text
from ppswap.scheduler.validate import validate_all, validate_order

__all__ = [
    "MIN_TEXT_WIDTH",
    "TEXT_WIDTH",
    "add_plan_parser",
    "format_json",
    "plan_orders",
    "plan_payload",
    "run_plan",
]

TEXT_WIDTH = 100
"""The default ``--width`` of ``ppswap plan``'s text: no line of it is longer."""
MIN_TEXT_WIDTH = 50
"""The smallest ``--width`` other than 0: the memory table's rows are 42 characters."""
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
            header += (
                f" copy_leaves={copy_leaves_of(cost_model):g} cost_budget={cost_model.budget:g}"
            )
    view = "compute slots only" if compute_only else "finalized orders"
    title = f"{header} ({view})"
    lines = textwrap.wrap(title, width, subsequent_indent="  ") if width else [title]
    lines.append(format_grid(orders, compact=False, width=width))
    lines += ["", step_legend(orders, width=width or TEXT_WIDTH)]
    return "\n".join(lines)


def run_plan(args: argparse.Namespace) -> int:
    """``ppswap plan``: print the per-rank orders of one schedule."""
    try:
        config = config_from_args(args)
        cost_model = cost_model_from_args(args)
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


def add_plan_parser(subparsers: Any) -> None:
    """Register ``ppswap plan`` on ``subparsers`` (its handler: ``run_plan``)."""
    plan = subparsers.add_parser(
        "plan",
        help="print the per-rank MetaStep orders of a schedule",
        description="Build, validate and print every rank's order of a pipeline schedule.",
    )
    add_schedule_arguments(plan)
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
