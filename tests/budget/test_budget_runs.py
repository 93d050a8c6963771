"""memory_budget in real runs on each backend: the planner's mix of keep, swap and
recompute keeps every rank's measured peak of saved bytes within its budget, bit-identical
to keeping everything (across processes: ``tests/across_processes/test_budget.py``).

Per backend (``backend``: MindSpore, marked ``mindspore``; torch) and schedule (GPipe,
1F1B, 1F1B + overlap_b_f, Interleaved, and with a dx/dw split 1F1B + split_dw and
Interleaved Zero Bubble, planned with the backend's ``saved_until``: torch holds a split
chunk until its BWD_WEIGHT, MindSpore releases it at its BWD_INPUT), every block of the
stages is wrapped by both ``recompute_wrapper`` and ``swap_wrapper`` (the plan chooses per
chunk). torch's blocks hold a dropout (p 0.2: a recomputed forward must replay its
masks); MindSpore's are the demo's deterministic MLP blocks (its ``recompute_wrapper``
refuses a dropout whose masks cannot be replayed). Three calibration runs measure what
the planner needs and the budgets' bases: keep everything (its peak), swap by the gap rule
(what a swap moves) and recompute everything (what a recomputed chunk keeps and
regenerates, its peak). Budgets of 75% and 50% of the keep-everything peak and
recompute-everything's peak itself (none below the least budget the planner meets:
``least_budgets``) are then met on every rank; losses and gradients equal the keep run's
bit for bit. Without overlap the planner meets recompute-everything's measured peak and its
predicted peak is within 5% of the measured one; with overlap_b_f the prediction is an
upper bound of the measurement (docs/memory-model.md). A budget below the least is refused
before anything runs, naming ``memory_budget``, the rank and the least budget, which is
then met.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest

from ppswap import PipelineStage, RunResult, recompute_wrapper, run_schedule
from ppswap.scheduler.budget import least_budgets
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel
from ppswap.swap import swap_wrapper

BACKENDS = [pytest.param("mindspore", marks=pytest.mark.mindspore), "torch"]
CASES = {
    "gpipe": dict(schedule="gpipe", stage_num=2, pp=2),
    "1f1b": dict(schedule="1f1b", stage_num=2, pp=2),
    "1f1b-overlap": dict(schedule="1f1b", stage_num=2, pp=2, overlap_b_f=True),
    "interleaved": dict(schedule="interleaved_1f1b", stage_num=4, pp=2),
    "1f1b-dxdw": dict(schedule="1f1b", stage_num=2, pp=2, split_dw=True),
    "interleaved-zb": dict(schedule="interleaved_zb", stage_num=4, pp=2),
}
MICRO = 8


def _wrap(block: Any) -> Any:
    return recompute_wrapper(swap_wrapper(block))


@dataclass(frozen=True)
class Kit:
    """A backend's stages, batch, loss, and its gradients as host arrays."""

    stages: Callable[[int], list[PipelineStage]]
    inputs: Any
    targets: Any
    loss_fn: Any
    grads: Callable[[list[PipelineStage]], list[np.ndarray]]
    before_run: Callable[[list[PipelineStage]], None]


def mindspore_kit() -> Kit:
    pytest.importorskip("mindspore")
    from ppswap.demo.model import build_mlp_stages, mse_loss

    def stages(stage_num: int) -> list[PipelineStage]:
        modules = build_mlp_stages(stage_num, wrap=_wrap)
        return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]

    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 16)).astype(np.float32)
    y = rng.standard_normal((16, 16)).astype(np.float32)
    return Kit(
        stages,
        x,
        y,
        mse_loss,
        lambda stages: [g.asnumpy().copy() for s in stages for g in s.grads],
        lambda stages: None,
    )


def torch_kit() -> Kit:
    torch = pytest.importorskip("torch")
    from torch import nn

    dim = 16

    class Block(nn.Module):
        """``x + fc2(dropout(tanh(fc1(x))))``."""

        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
            self.drop = nn.Dropout(0.2)

        def forward(self, x: Any) -> Any:
            return x + self.fc2(self.drop(torch.tanh(self.fc1(x))))

    def stages(stage_num: int) -> list[PipelineStage]:
        with torch.random.fork_rng():
            torch.manual_seed(0)
            modules = [nn.Sequential(*(_wrap(Block()) for _ in range(2))) for _ in range(stage_num)]
        return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]

    def grads(stages: list[PipelineStage]) -> list[np.ndarray]:
        return [g.detach().numpy().copy() for s in stages for g in s.grads]

    def mse(output: Any, target: Any) -> Any:
        return ((output - target) ** 2).mean()

    def before_run(stages: list[PipelineStage]) -> None:
        """No gradient left from the last run, and the dropout masks drawn from one state."""
        for stage in stages:
            for param in stage.parameters:
                param.grad = None
        torch.manual_seed(5)

    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 8, dim)).astype(np.float32)
    y = rng.standard_normal((8, 8, dim)).astype(np.float32)
    return Kit(stages, x, y, mse, grads, before_run)


KITS = {"mindspore": mindspore_kit, "torch": torch_kit}


def run(kit: Kit, stages: list[PipelineStage], case: dict[str, Any], **options: Any) -> RunResult:
    kwargs = {k: v for k, v in case.items() if k not in ("schedule", "stage_num")}
    kit.before_run(stages)

    async def main() -> RunResult:
        return await run_schedule(
            stages,
            case["schedule"],
            micro_batch_num=MICRO,
            inputs=kit.inputs,
            targets=kit.targets,
            loss_fn=kit.loss_fn,
            step_timeout=60.0,
            **kwargs,
            **options,
        )

    return anyio.run(main)


def peaks(result: RunResult) -> list[int]:
    return [rank.peak_saved_bytes for rank in result.ranks]


def calibrate(
    kit: Kit, stages: list[PipelineStage], case: dict[str, Any]
) -> tuple[RunResult, RunResult, CostModel]:
    """The keep-everything and recompute-everything runs, and the model of all three."""
    keep = run(kit, stages, case)
    swapped = run(kit, stages, case, swap=True)
    recomputed = run(kit, stages, case, recompute=True)
    return keep, recomputed, CostModel.from_result(keep, swapped, recomputed)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_budget_met_and_bit_identical(backend: str, name: str) -> None:
    kit = KITS[backend]()
    case = CASES[name]
    stages = kit.stages(case["stage_num"])
    keep, recomputed, model = calibrate(kit, stages, case)
    keep = run(kit, stages, case)  # the reference gradients: those of this keep run
    keep_grads = kit.grads(stages)
    overlap = bool(case.get("overlap_b_f"))
    config = ScheduleConfig(
        schedule=case["schedule"],
        pp=case["pp"],
        vpp=case["stage_num"] // case["pp"],
        micro=MICRO,
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
        # one int where every rank has the same budget, else a mapping: both forms
        given = budget[0] if len(set(budget)) == 1 else dict(enumerate(budget))
        result = run(kit, stages, case, swap=True, memory_budget=given, cost_model=model)
        for rank, stats in enumerate(result.ranks):
            measured = stats.peak_saved_bytes
            assert measured <= budget[rank], (label, rank, peaks(result), budget)
            predicted = stats.predicted_peak_saved_bytes
            if overlap:
                assert predicted >= measured, (label, rank, predicted, measured)
            else:
                assert abs(predicted - measured) <= 0.05 * measured, (label, rank, predicted)
            assert stats.predicted_step_s > 0
            assert set(stats.chunk_policy.values()) <= {"keep", "swap", "recompute"}
        assert result.losses == keep.losses, label
        got = kit.grads(stages)
        assert all(np.array_equal(a, b) for a, b in zip(got, keep_grads, strict=True)), label
    # at recompute-everything's peak something is not kept
    assert any(set(r.chunk_policy.values()) != {"keep"} for r in result.ranks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_impossible_budget_refused_naming_the_least(backend: str) -> None:
    kit = KITS[backend]()
    case = CASES["1f1b"]
    stages = kit.stages(2)
    _, recomputed, model = calibrate(kit, stages, case)
    too_small = min(peaks(recomputed)) // 4
    with pytest.raises(
        ValueError, match=r"memory_budget .* rank \d needs at least \d+ bytes"
    ) as refused:
        run(kit, stages, case, swap=True, memory_budget=too_small, cost_model=model)
    named = [int(n) for n in re.findall(r"needs at least (\d+) bytes", str(refused.value))]
    result = run(kit, stages, case, swap=True, memory_budget=max(named), cost_model=model)
    assert max(peaks(result)) <= max(named)  # the least budget named is met
