"""Tied parameters on torch, in one process (``ppswap/planning/ties.py``): a GPT-2 style
model whose head multiplies by the input embedding's weight (``tests/tied_model.py``; the
schedules, the dx/dw split and overlap on both backends:
``tests/both_backends/test_tied_in_one_process.py``).

With FSDP the shards are summed shard-wise; bad declarations are refused before the run,
naming the stages; the sum is a step of the holder ranks, which a fault plan can fail,
cancel or stall.
"""

from __future__ import annotations

import json
from typing import Any

import anyio
import pytest
import torch
from tied_model import TIED, lm_loss, tied_modules, tokens, unsplit

from ppswap import PipelineError, PipelineHangError, PipelineStage, run_schedule
from ppswap.core.faults import FaultPlan, call_at, delay_compute, fail_compute
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.fsdp.shard import full_gradients
from ppswap.scheduler.steps import StepKind


def stages_of(stage_num: int, *, shared: bool, declare: bool) -> list[PipelineStage]:
    modules = tied_modules(stage_num, shared=shared)
    tied = {0: TIED[0], stage_num - 1: TIED[-1]} if declare else {}
    return [
        PipelineStage(module, index, stage_num, tied=tied.get(index))
        for index, module in enumerate(modules)
    ]


async def train(
    stages: list[PipelineStage], schedule: str, pp: int, swap: bool, **options: Any
) -> float:
    x, y = tokens()
    result = await run_schedule(
        stages,
        schedule,
        pp=pp,
        micro_batch_num=4,
        inputs=x,
        targets=y,
        loss_fn=lm_loss,
        swap=swap,
        step_timeout=60.0,
        **options,
    )
    return result.loss


def tied_index(stage: PipelineStage, weight: torch.Tensor) -> int:
    return next(i for i, p in enumerate(stage.parameters) if p is weight)


@pytest.mark.asyncio
async def test_fsdp_sums_the_tied_shards() -> None:
    """GPipe pp2 x dp2: each replica's copies declared tied; after the run each holder's
    shard gradient is the sum of both holders' shards, and the full gradients equal the
    unsplit model's."""
    stage_num, mesh = 2, DeviceMesh(pp=2, dp=2)
    _, want = unsplit(stage_num)
    stages = []
    for dp_rank in range(mesh.dp):
        for index, module in enumerate(tied_modules(stage_num, shared=False)):
            fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            tied = TIED[0] if index == 0 else TIED[-1]
            stages.append(PipelineStage(module, index, stage_num, tied=tied))
    x, y = tokens()
    result = await run_schedule(
        stages, "gpipe", micro_batch_num=2, inputs=x, targets=y, loss_fn=lm_loss, mesh=mesh
    )
    assert result.loss == pytest.approx(unsplit(stage_num)[0], rel=1e-6)
    by_index = {(s.stage_index, r): s for r in range(2) for s in stages[r * 2 : r * 2 + 2]}
    for replica in range(mesh.dp):
        first, last = by_index[(0, replica)], by_index[(1, replica)]
        k_first = tied_index(first, first.module.wte.weight)
        k_last = tied_index(last, last.module.head.weight)
        assert torch.equal(first.grads[k_first], last.grads[k_last])
    firsts = full_gradients([s for s in stages if s.stage_index == 0])
    lasts = full_gradients([s for s in stages if s.stage_index == 1])
    assert (firsts[0] == lasts[-1]).all()  # the tied weight's full gradient, on both
    for full, reference in ((firsts, want[0]), (lasts[:-1], want[1][:-1])):
        for grad, expected in zip(full, reference, strict=True):
            torch.testing.assert_close(torch.from_numpy(grad), expected, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.from_numpy(firsts[0]), want[0][0], rtol=1e-5, atol=1e-7)


def test_declared_copies_must_agree() -> None:
    """Refused before anything runs, in one line naming both stages, the name, the key."""
    modules = tied_modules(2, shared=False)
    modules[1].head.weight = torch.nn.Parameter(torch.zeros(3, 8))
    stages = [
        PipelineStage(modules[0], 0, 2, tied=TIED[0]),
        PipelineStage(modules[1], 1, 2, tied=TIED[-1]),
    ]
    with pytest.raises(ValueError, match=r"stage 0's 'wte.weight' .* stage 1's 'head.weight'"):
        run(stages)
    lonely = [PipelineStage(modules[0], 0, 2, tied=TIED[0]), PipelineStage(modules[1], 1, 2)]
    with pytest.raises(ValueError, match="declared only by stage 0"):
        run(lonely)
    typo = [PipelineStage(modules[0], 0, 2, tied={"wte.wieght": "e"}), stages[1]]
    with pytest.raises(ValueError, match=r"'wte\.wieght' is not a trainable parameter of stage 0"):
        run(typo)


def run(stages: list[PipelineStage]) -> None:
    anyio.run(train, stages, "gpipe", 2, False)


def assert_equals_unsplit(stages: list[PipelineStage]) -> None:
    _, want = unsplit(len(stages))
    last = stages[-1]
    k_last = tied_index(last, last.module.head.weight)
    for stage, reference in zip(stages, want, strict=True):
        reference = reference if stage is not last else [*reference[:-1], want[0][0]]
        for grad, expected in zip(stage.grads, reference, strict=True):
            torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(last.grads[k_last], stages[0].grads[0])


@pytest.mark.asyncio
async def test_the_sum_is_a_step_of_the_holder_ranks(tmp_path: Any) -> None:
    """1F1B pp4: TIED_GRAD_SUM is a step the compute actors of ranks 0 and 3 run (a span
    on their compute lane in the Chrome trace, from handing their share over to the
    sum's end; none on ranks 1 and 2); a fault plan fails it (a PipelineError naming
    the rank, the compute actor and the step) or cancels the run there, and the same
    stages then train to the unsplit model's gradients."""
    stages = stages_of(4, shared=False, declare=True)
    trace = tmp_path / "tied.json"
    x, y = tokens()
    common: dict[str, Any] = {
        "micro_batch_num": 4,
        "inputs": x,
        "targets": y,
        "loss_fn": lm_loss,
        "step_timeout": 60.0,
    }
    result = await run_schedule(stages, "1f1b", trace=trace, **common)
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {(e["pid"], e["args"]["name"]): e["tid"] for e in events if e["name"] == "thread_name"}
    sums = [(e["pid"], e["tid"]) for e in events if e["ph"] == "X" and e["name"].startswith("TS")]
    assert sorted(sums) == [(0, lanes[(0, "compute")]), (3, lanes[(3, "compute")])]
    assert {e["name"] for e in events if e["name"].startswith("TS")} == {"TS.s0", "TS.s3"}
    untied = await run_schedule(stages_of(4, shared=False, declare=False), "1f1b", **common)
    pairs = zip(result.ranks, untied.ranks, strict=True)
    steps = [tied.steps_executed - plain.steps_executed for tied, plain in pairs]
    assert steps == [1, 0, 0, 1]  # the holders' TIED_GRAD_SUM
    assert_equals_unsplit(stages)

    fail = FaultPlan((fail_compute(StepKind.TIED_GRAD_SUM, rank=3),))
    with pytest.raises(PipelineError) as failed:
        await run_schedule(stages, "1f1b", faults=fail, **common)
    error = failed.value
    assert (error.rank, error.actor, error.step) == (3, "compute", "TS.s3"), error
    assert "injected raise at compute of rank 3, TS.s3" in str(error)

    with anyio.CancelScope() as scope:
        cancel = FaultPlan((call_at(scope.cancel, StepKind.TIED_GRAD_SUM, rank=0),))
        await run_schedule(stages, "1f1b", faults=cancel, **common)
    assert scope.cancelled_caught

    again = await run_schedule(stages, "1f1b", **common)
    assert again.loss == result.loss
    assert_equals_unsplit(stages)


@pytest.mark.asyncio
async def test_a_stuck_sum_is_a_hang_named_at_its_step() -> None:
    """A DELAY rule stalls rank 3's sum past the step deadline: the run ends with a
    PipelineHangError at a TIED_GRAD_SUM of the compute actor, whose dump shows the
    batch at the step; the same stages then train to the unsplit model's gradients."""
    stages = stages_of(4, shared=False, declare=True)
    x, y = tokens()
    common: dict[str, Any] = {"micro_batch_num": 4, "inputs": x, "targets": y, "loss_fn": lm_loss}
    stuck = FaultPlan((delay_compute(3.0, StepKind.TIED_GRAD_SUM, rank=3),))
    with pytest.raises(PipelineHangError) as hung:
        await run_schedule(stages, "1f1b", faults=stuck, step_timeout=1.0, **common)
    error = hung.value
    assert error.actor == "compute" and error.step in ("TS.s0", "TS.s3"), error
    assert "compute thread: running BatchRun.run (rank 3 at TS.s3" in str(error), error
    await run_schedule(stages, "1f1b", step_timeout=60.0, **common)
    assert_equals_unsplit(stages)
