"""A forward-only run without ``loss_fn`` returns the last stage's outputs (inference).

Checked: per micro-batch, in batch order, each equal to the unsplit model on that
micro-batch (every schedule family, Interleaved in the boundary P2P mode); a last stage
that returns a tuple gives tuples; with FSDP dp2 the replicas' outputs follow one another
in batch order; no targets needed, no losses; a training run still needs ``loss_fn``,
and other runs return no outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch_support import BATCH, Case, build_modules, make_data, mse_loss

from ppswap import PipelineStage, run_schedule
from ppswap.fsdp import DeviceMesh, fully_shard

CASES = [
    Case("gpipe", pp=2, stage_num=2, micro=4),
    Case("1f1b", pp=4, stage_num=4, micro=8),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4, p2p="boundary"),
]


def expected(stage_num: int, micro: int) -> list[torch.Tensor]:
    """The unsplit model (the same seed) on each micro-batch."""
    model = nn.Sequential(*build_modules(stage_num))
    x, _ = make_data()
    with torch.no_grad():
        return [model(part) for part in torch.from_numpy(x).chunk(micro)]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=[c.label() for c in CASES])
async def test_outputs_are_the_last_stages_per_micro_batch(case: Case) -> None:
    stages = [
        PipelineStage(m, i, case.stage_num) for i, m in enumerate(build_modules(case.stage_num))
    ]
    x, _ = make_data()
    result = await run_schedule(
        stages,
        case.schedule,
        pp=case.pp,
        micro_batch_num=case.micro,
        inputs=x,
        forward_only=True,
        p2p=case.p2p,
    )
    assert result.losses == [] and np.isnan(result.loss)
    assert len(result.outputs) == case.micro
    for got, want in zip(result.outputs, expected(case.stage_num, case.micro), strict=True):
        assert isinstance(got, np.ndarray)
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-6, atol=1e-7)


class Pair(nn.Module):
    """The last stage returning its output and that output doubled."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out: torch.Tensor = self.inner(x)
        return out, 2 * out


@pytest.mark.asyncio
async def test_a_last_stage_returning_a_tuple_gives_tuples() -> None:
    modules = build_modules(2)
    stages = [PipelineStage(modules[0], 0, 2), PipelineStage(Pair(modules[1]), 1, 2)]
    x, _ = make_data()
    result = await run_schedule(stages, "gpipe", micro_batch_num=2, inputs=x, forward_only=True)
    for (out, doubled), want in zip(result.outputs, expected(2, 2), strict=True):
        torch.testing.assert_close(torch.from_numpy(out), want, rtol=1e-6, atol=1e-7)
        assert np.array_equal(doubled, 2 * out)


@pytest.mark.asyncio
async def test_fsdp_replicas_outputs_follow_one_another_in_batch_order() -> None:
    mesh = DeviceMesh(pp=2, dp=2)
    stages = []
    for dp_rank in range(mesh.dp):
        for index, module in enumerate(build_modules(2)):
            fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            stages.append(PipelineStage(module, index, 2))
    x, _ = make_data()
    result = await run_schedule(stages, "gpipe", micro_batch_num=2, inputs=x, forward_only=True)
    assert len(result.outputs) == 4  # 2 replicas x 2 micro-batches of BATCH / 4 samples
    assert sum(out.shape[0] for out in result.outputs) == BATCH
    for got, want in zip(result.outputs, expected(2, 4), strict=True):
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-6, atol=1e-7)


@pytest.mark.asyncio
async def test_a_training_run_still_needs_loss_fn_and_returns_no_outputs() -> None:
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(build_modules(2))]
    x, y = make_data()
    with pytest.raises(TypeError, match=r"loss_fn must be a callable.*only with forward_only=True"):
        await run_schedule(stages, "gpipe", micro_batch_num=2, inputs=x, targets=y)
    trained = await run_schedule(
        stages, "gpipe", micro_batch_num=2, inputs=x, targets=y, loss_fn=mse_loss
    )
    evaluated = await run_schedule(
        stages,
        "gpipe",
        micro_batch_num=2,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        forward_only=True,
    )
    assert trained.outputs == [] and evaluated.outputs == []
    assert evaluated.losses == trained.losses
