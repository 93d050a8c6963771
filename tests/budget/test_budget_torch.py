"""memory_budget on torch, real runs: the planner's mix of keep, swap and recompute keeps
every rank's measured peak of saved bytes within its budget, bit-identical to keeping
everything.

Per schedule (GPipe, 1F1B, 1F1B + overlap_b_f, Interleaved, and with a dx/dw split 1F1B +
split_dw and Interleaved Zero Bubble, whose chunks torch holds until their BWD_WEIGHT:
the plan is made with ``saved_until="weight"``), the stages' blocks are
wrapped by both ``recompute_wrapper`` and ``swap_wrapper`` (the plan chooses per chunk).
Three calibration runs measure what the planner needs and the budgets' bases: keep
everything (its peak), swap by the gap rule (what a swap moves) and recompute everything
(what a recomputed chunk keeps and regenerates, its peak). Budgets of 75% and 50% of the
keep-everything peak and recompute-everything's peak itself (none below the least budget
the planner meets: ``least_budgets``) are then met on every rank; losses and gradients
equal the keep run's bit for bit (dropout included); a budget below the least is refused
before anything runs, naming ``memory_budget``, the rank and the least budget.

The prediction: without overlap the planner meets recompute-everything's measured peak and
its predicted peak is within 5% of the measured one. An OVERLAP_B_F composite counts both
its chunks in the model, while the runtime runs whichever leaf is ready first (on the last
stage usually the backward, which releases its chunk before the forward saves): there the
prediction is an upper bound of the measurement.
"""

from __future__ import annotations

from typing import Any

import anyio
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ppswap import PipelineStage, RunResult, recompute_wrapper, run_schedule  # noqa: E402
from ppswap.scheduler.budget import least_budgets  # noqa: E402
from ppswap.scheduler.config import ScheduleConfig  # noqa: E402
from ppswap.scheduler.cost_model import CostModel  # noqa: E402
from ppswap.swap import swap_wrapper  # noqa: E402

DIM, SEQ, BATCH = 16, 8, 8


class Block(nn.Module):
    """``x + fc2(dropout(tanh(fc1(x))))``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: Any) -> Any:
        return x + self.fc2(self.drop(torch.tanh(self.fc1(x))))


def make_stages(stage_num: int) -> list[PipelineStage]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        modules = [
            nn.Sequential(*(recompute_wrapper(swap_wrapper(Block())) for _ in range(2)))
            for _ in range(stage_num)
        ]
    return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]


def mse(output: Any, target: Any) -> Any:
    return ((output - target) ** 2).mean()


CASES = {
    "gpipe": dict(schedule="gpipe", stage_num=2, pp=2),
    "1f1b": dict(schedule="1f1b", stage_num=2, pp=2),
    "1f1b-overlap": dict(schedule="1f1b", stage_num=2, pp=2, overlap_b_f=True),
    "interleaved": dict(schedule="interleaved_1f1b", stage_num=4, pp=2),
    "1f1b-dxdw": dict(schedule="1f1b", stage_num=2, pp=2, split_dw=True),
    "interleaved-zb": dict(schedule="interleaved_zb", stage_num=4, pp=2),
}


def run(stages: list[PipelineStage], case: dict[str, Any], **options: Any) -> RunResult:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, SEQ, DIM)).astype(np.float32)
    y = rng.standard_normal((BATCH, SEQ, DIM)).astype(np.float32)
    for stage in stages:
        for param in stage.parameters:
            param.grad = None
    torch.manual_seed(5)
    kwargs = {k: v for k, v in case.items() if k not in ("schedule", "stage_num")}

    async def main() -> RunResult:
        return await run_schedule(
            stages,
            case["schedule"],
            micro_batch_num=8,
            inputs=x,
            targets=y,
            loss_fn=mse,
            step_timeout=60.0,
            **kwargs,
            **options,
        )

    return anyio.run(main)


def grads(stages: list[PipelineStage]) -> list[Any]:
    return [g.detach().clone() for stage in stages for g in stage.grads]


def peaks(result: RunResult) -> list[int]:
    return [rank.peak_saved_bytes for rank in result.ranks]


@pytest.mark.parametrize("name", sorted(CASES))
def test_budget_met_and_bit_identical(name: str) -> None:
    case = CASES[name]
    stages = make_stages(case["stage_num"])
    keep = run(stages, case)
    keep_grads = grads(stages)
    swapped = run(stages, case, swap=True)
    recomputed = run(stages, case, recompute=True)
    model = CostModel.from_result(keep, swapped, recomputed)
    overlap = bool(case.get("overlap_b_f"))
    config = ScheduleConfig(
        schedule=case["schedule"],
        pp=case["pp"],
        vpp=case["stage_num"] // case["pp"],
        micro=8,
        overlap_b_f=overlap,
        split_dw=bool(case.get("split_dw")),
        swap=True,
        saved_until=stages[0].backend.saved_until,
    )
    least = least_budgets(config, model, frozenset(range(case["stage_num"])))
    if not overlap:  # recompute-everything's peak is within what the planner meets
        assert all(a <= b for a, b in zip(least, peaks(recomputed), strict=True))
    budgets = {
        label: [max(int(share * p), q) for p, q in zip(peaks(keep), least, strict=True)]
        for label, share in (("75%", 0.75), ("50%", 0.5))
    }
    budgets["recompute-all"] = [max(p, q) for p, q in zip(peaks(recomputed), least, strict=True)]
    assert min(budgets["50%"][r] / peaks(keep)[r] for r in range(case["pp"])) < 1  # binds
    for label, budget in budgets.items():
        result = run(
            stages,
            case,
            swap=True,
            memory_budget=dict(enumerate(budget)),
            cost_model=model,
        )
        measured = peaks(result)
        for rank, stats in enumerate(result.ranks):
            assert stats.peak_saved_bytes <= budget[rank], (label, rank, measured, budget)
            predicted = stats.predicted_peak_saved_bytes
            assert predicted >= stats.peak_saved_bytes or not overlap
            if not overlap:
                assert abs(predicted - stats.peak_saved_bytes) <= 0.05 * stats.peak_saved_bytes, (
                    label,
                    rank,
                    predicted,
                    measured,
                )
            assert stats.predicted_step_s > 0
            assert set(stats.chunk_policy.values()) <= {"keep", "swap", "recompute"}
        assert result.losses == keep.losses
        assert all(torch.equal(a, b) for a, b in zip(grads(stages), keep_grads, strict=True)), label
    moved = [
        rank.chunk_policy for rank in result.ranks if set(rank.chunk_policy.values()) != {"keep"}
    ]
    assert moved  # at recompute-everything's peak something is not kept


def test_impossible_budget_refused_before_running() -> None:
    case = CASES["1f1b"]
    stages = make_stages(2)
    keep = run(stages, case)
    recomputed = run(stages, case, recompute=True)
    swapped = run(stages, case, swap=True)
    model = CostModel.from_result(keep, swapped, recomputed)
    least = min(peaks(recomputed))
    with pytest.raises(ValueError, match=r"memory_budget .* rank \d needs at least \d+ bytes"):
        run(stages, case, swap=True, memory_budget=least // 4, cost_model=model)
    before = grads(stages)
    with pytest.raises(ValueError) as refused:
        run(stages, case, swap=True, memory_budget=least // 4, cost_model=model)
    named = [
        int(n) for n in __import__("re").findall(r"needs at least (\d+) bytes", str(refused.value))
    ]
    # the least budget named is met
    result = run(stages, case, swap=True, memory_budget=max(named), cost_model=model)
    assert max(peaks(result)) <= max(named)
    assert all(torch.equal(a, b) for a, b in zip(before, before, strict=True))
