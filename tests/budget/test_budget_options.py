"""memory_budget's refusals at the call, the pure planner's contract, ``ppswap plan
--memory-budget`` (no framework needed)."""

from __future__ import annotations

import pytest

from ppswap.cli import main
from ppswap.options import RunOptions
from ppswap.scheduler.budget import BudgetError, least_budgets, plan_memory_budget
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel, StageBytes

SIZES = StageBytes(kept=1000, moved=800, recompute_held=200, regenerated=900)


def model(stages: int) -> CostModel:
    return CostModel(
        chunk_bytes=800, d2h_gbps=1.0, h2d_gbps=1.0, leaf_s=1e-3, stage_bytes=(SIZES,) * stages
    )


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"memory_budget": 0}, ValueError, "memory_budget must be a positive int"),
        ({"memory_budget": -5}, ValueError, "memory_budget must be a positive int"),
        ({"memory_budget": 1.5}, TypeError, "memory_budget must be a positive int"),
        ({"memory_budget": True}, TypeError, "memory_budget must be a positive int"),
        ({"memory_budget": {0: 0}}, ValueError, r"memory_budget\[0\] must be"),
        ({"memory_budget": {"0": 10}}, TypeError, "memory_budget's keys must be ranks"),
        ({"memory_budget": {0: 10}, "pp": 2}, ValueError, r"missing rank\(s\) \[1\]"),
        ({"memory_budget": {0: 10, 1: 10, 2: 10}, "pp": 2}, ValueError, r"rank\(s\) \[2\] outside"),
        ({"memory_budget": 10, "forward_only": True}, ValueError, "forward-only"),
        ({"memory_budget": 10}, ValueError, "memory_budget needs cost_model"),
        ({"memory_budget": 10, "recompute": True}, ValueError, "recompute False"),
    ],
)
def test_refused_at_the_call(options: dict[str, object], error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        RunOptions(micro_batch_num=4, **options)  # type: ignore[arg-type]


def test_accepted_with_a_measured_model() -> None:
    options = RunOptions(micro_batch_num=4, pp=2, memory_budget={0: 10, 1: 20}, cost_model=model(2))
    assert options.memory_budget == {0: 10, 1: 20}


def test_plan_meets_the_budget_and_refuses_below_the_least() -> None:
    config = ScheduleConfig(schedule="interleaved_1f1b", pp=4, vpp=2, micro=8, swap=True)
    stages = frozenset(range(8))
    least = least_budgets(config, model(8), stages)
    keep = plan_memory_budget(config, model(8), (10**9,) * 4, stages)
    assert all(r.peak_bytes == r.keep_peak_bytes for r in keep.ranks)
    assert set(keep.policies.values()) == {"keep"}
    half = tuple(max(r.keep_peak_bytes // 2, low) for r, low in zip(keep.ranks, least, strict=True))
    plan = plan_memory_budget(config, model(8), half, stages)
    assert all(r.peak_bytes <= b for r, b in zip(plan.ranks, half, strict=True))
    assert set(plan.policies.values()) > {"keep"}
    assert plan.policies == plan_memory_budget(config, model(8), half, stages).policies
    exact = plan_memory_budget(config, model(8), least, stages)  # the least is met
    assert [r.peak_bytes for r in exact.ranks] <= list(least)
    with pytest.raises(
        BudgetError, match=rf"memory_budget .*rank 0 needs at least {least[0]} bytes"
    ):
        plan_memory_budget(config, model(8), (least[0] - 1, *least[1:]), stages)


def test_without_swap_or_recompute_nothing_lowers_the_peak() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, vpp=1, micro=4, swap=False)
    least = least_budgets(config, model(2))
    assert least == (4000, 4000)  # every chunk kept: the budget needs what wrappers offer


def test_cli_prints_the_policy(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--schedule", "gpipe", "--pp", "2", "--micro", "4", "--swap", "--recompute"]
    assert main([*argv, "--memory-budget", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: budget 2, predicted peak" in out and "stage 0:" in out
    assert main([*argv, "--memory-budget", "0.1"]) != 0
    assert "memory_budget" in capsys.readouterr().err
