"""``ppswap plan --memory-budget N``: the budget planner's per-chunk policy, printed.

The command line has no measured step, so it plans in units of a chunk: every chunk of
every stage keeps ``CLI_CHUNK_BYTES`` bytes; a swap moves all of them (with ``--swap``); a
recomputed chunk (with ``--recompute``: every stage's blocks are recompute-wrapped) keeps
``--recompute-share`` of them until its RECOMPUTE and regenerates the rest; times are the
cost policy's command-line model (``cli.cli_cost_model``: a leaf takes 1 s, a copy
``--copy-leaves`` leaves). ``--memory-budget`` is in chunks (a float: 2.5 is two and a
half chunks' bytes) for every rank.
"""

from __future__ import annotations

from dataclasses import replace

from ppswap.scheduler.budget import BudgetPlan, plan_memory_budget
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel, StageBytes

__all__ = ["CLI_CHUNK_BYTES", "budget_plan", "budget_text"]

CLI_CHUNK_BYTES = 1000
_CODES = {"keep": "K", "swap": "S", "recompute": "R", "recompute+swap": "RS"}


def budget_plan(
    config: ScheduleConfig,
    cost: CostModel,
    *,
    budget_chunks: float,
    recompute: bool,
    recompute_share: float,
) -> BudgetPlan:
    """The plan of ``budget_chunks`` chunks per rank (module docstring); ValueError naming
    the option for a bad value, or naming ``memory_budget`` for an impossible budget."""
    if not budget_chunks > 0:
        raise ValueError(f"memory_budget must be a number of chunks > 0, got {budget_chunks!r}")
    if not 0 <= recompute_share < 1:
        raise ValueError(f"recompute_share must be a number in [0, 1), got {recompute_share!r}")
    held = int(CLI_CHUNK_BYTES * recompute_share)
    sizes = StageBytes(
        kept=CLI_CHUNK_BYTES,
        moved=CLI_CHUNK_BYTES if config.swap else None,
        recompute_held=held if recompute else None,
        regenerated=CLI_CHUNK_BYTES - held if recompute else None,
    )
    cost = replace(cost, stage_bytes=(sizes,) * config.num_stages)
    budgets = (int(budget_chunks * CLI_CHUNK_BYTES),) * config.pp
    stages = frozenset(range(config.num_stages)) if recompute else frozenset()
    return plan_memory_budget(config, cost, budgets, stages)


def budget_text(plan: BudgetPlan) -> str:
    """Per rank: the budget, the predicted peak (both in chunks), the count of each policy
    and every chunk's policy (K keep, S swap, R recompute) by stage and micro-batch."""
    lines = [
        "memory budget plan (chunks; K keep, S swap, R recompute): predicted step "
        f"{plan.step_s:.1f} leaves (keep everything: {plan.keep_step_s:.1f})"
    ]
    unit = CLI_CHUNK_BYTES
    for rank in plan.ranks:
        counts = {policy: 0 for policy in _CODES}
        for _, policy in rank.policies:
            counts[policy] += 1
        lines.append(
            f"rank {rank.rank}: budget {rank.budget / unit:g}, predicted peak "
            f"{rank.peak_bytes / unit:g} (keep {rank.keep_peak_bytes / unit:g}"
            f", least {rank.least_bytes / unit:g}); keep {counts['keep']}, swap "
            f"{counts['swap']}, recompute {counts['recompute']}"
        )
        by_stage: dict[int, list[str]] = {}
        for (stage, micro), policy in rank.policies:
            by_stage.setdefault(stage, []).append(f"{micro}{_CODES[policy]}")
        for stage, cells in sorted(by_stage.items()):
            lines.append(f"  stage {stage}: {' '.join(cells)}")
    return "\n".join(lines)
