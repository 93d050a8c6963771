"""The schedule options ``ppswap plan`` and ``ppswap plot`` share, and the configuration
and cost model they make of them.

``--backend`` (default mindspore) says where the memory model frees a chunk whose backward
is split (``ScheduleConfig.saved_until``). ``--swap-policy cost`` plans with
``cli_cost_model``: a chunk's copy each way takes ``--copy-leaves`` compute leaves
(default 1) and the predicted exposed wait may use ``--cost-budget`` of the step (default
``DEFAULT_COST_BUDGET``, 2%). ``--vpp``'s default is ``cli_args.vpp_of``'s.
"""

from __future__ import annotations

import argparse

from ppswap.cli_args import VPP_HELP, vpp_of
from ppswap.scheduler.config import (
    DEFAULT_MIN_SWAP_GAP,
    P2P_MODES,
    SCHEDULE_NAMES,
    SavedUntil,
    ScheduleConfig,
)
from ppswap.scheduler.cost import DEFAULT_COST_BUDGET, SWAP_POLICIES, CostModel

__all__ = [
    "CLI_COPY_LEAVES",
    "SAVED_UNTIL_OF_BACKEND",
    "add_schedule_arguments",
    "cli_cost_model",
    "config_from_args",
    "copy_leaves_of",
    "cost_model_from_args",
]

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


def copy_leaves_of(model: CostModel) -> float:
    """The ``copy_leaves`` that ``cli_cost_model`` made ``model`` with."""
    return _CLI_CHUNK_BYTES / (model.d2h_gbps * 1e9 * model.leaf_s)


def cost_model_from_args(args: argparse.Namespace) -> CostModel | None:
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


def config_from_args(args: argparse.Namespace) -> ScheduleConfig:
    """The ``ScheduleConfig`` of the parsed options (its checks raise TypeError or
    ValueError naming the option)."""
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


def add_schedule_arguments(plan: argparse.ArgumentParser) -> None:
    """The schedule and swap options on the ``plan`` or ``plot`` sub-parser."""
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
