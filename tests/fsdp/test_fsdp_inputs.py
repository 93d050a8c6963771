"""Bad FSDP input is refused before anything runs; a failed run leaves the shards intact."""

from __future__ import annotations

import numpy as np
import pytest
from fsdp_support import DIM, batch, sharded_stages
from mindspore import Tensor

from ppswap import PipelineError, PipelineInputError, PipelineStage, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.fsdp import DeviceMesh, fsdp_state_of, full_gradients, fully_shard


def _unsharded(stage_num: int) -> list[PipelineStage]:
    modules = build_mlp_stages(stage_num, dim=DIM)
    return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]


def _mixed_meshes() -> list[PipelineStage]:
    stages = sharded_stages(2, DeviceMesh(pp=2, dp=2))
    other = DeviceMesh(pp=2, dp=1)
    module = build_mlp_stages(2, dim=DIM)[1]
    fully_shard(module, mesh=other, dp_rank=0)
    return [s for s in stages if s.stage_index == 0] + [PipelineStage(module, 1, 2)]


def _mixed_sharding() -> list[PipelineStage]:
    stages = sharded_stages(2, DeviceMesh(pp=2, dp=2))
    return [s for s in stages if s.stage_index == 0] + _unsharded(2)[1:]


def _missing_replica() -> list[PipelineStage]:
    stages = sharded_stages(2, DeviceMesh(pp=2, dp=2))
    return [s for s in stages if not (s.stage_index == 1 and s is stages[-1])]


def _duplicate_replica() -> list[PipelineStage]:
    mesh = DeviceMesh(pp=2, dp=2)
    first = sharded_stages(2, mesh)
    return first[:2] + sharded_stages(2, DeviceMesh(pp=2, dp=2))[:2]


CASES = [
    # (stages factory, run kwargs, error, match)
    (
        lambda: sharded_stages(4, DeviceMesh(pp=2, dp=2)),
        {"pp": 4},
        ValueError,
        r"does not match the run's ranks: mesh.pp \* mesh.dp = 4 ranks need mesh.pp == pp",
    ),
    (_mixed_meshes, {}, ValueError, "the dp group differs between stages"),
    (_mixed_sharding, {}, ValueError, r"every stage must be fully_shard\(\)-ed or none"),
    (_missing_replica, {}, ValueError, r"once per dp replica 0..1"),
    (_duplicate_replica, {}, ValueError, "must not repeat a stage index"),
    (
        lambda: sharded_stages(2, DeviceMesh(pp=2, dp=2)),
        {"mesh": DeviceMesh(pp=2, dp=4)},
        ValueError,
        "differs from the mesh the stages were sharded with",
    ),
    (
        lambda: _unsharded(2),
        {"mesh": DeviceMesh(pp=2, dp=2)},
        ValueError,
        "no stage is fully_shard",
    ),
    (
        lambda: sharded_stages(2, DeviceMesh(pp=2, dp=2)),
        {"mesh": (2, 2)},
        TypeError,
        "mesh must be a ppswap.DeviceMesh or None, got tuple",
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("factory", "kwargs", "error", "match"), CASES)
async def test_bad_fsdp_input_is_refused_before_anything_runs(
    factory,
    kwargs,
    error,
    match,  # type: ignore[no-untyped-def]
) -> None:
    stages = factory()
    x, y = batch(8)
    with pytest.raises(error, match=match):
        await run_schedule(
            stages, "gpipe", micro_batch_num=2, inputs=x, targets=y, loss_fn=mse_loss, **kwargs
        )
    assert all(s.generation == 0 for s in stages)
    for stage in stages:
        state = fsdp_state_of(stage.module)
        assert state is None or not state.unsharded


@pytest.mark.asyncio
async def test_batch_must_split_into_dp_blocks_of_micro_batches() -> None:
    stages = sharded_stages(2, DeviceMesh(pp=2, dp=2))
    x, y = batch(4)  # divisible by micro_batch_num=4, not by 4 micro-batches x dp=2
    with pytest.raises(PipelineInputError, match=r"micro_batch_num=4 x dp=2"):
        await run_schedule(
            stages, "gpipe", micro_batch_num=4, inputs=x, targets=y, loss_fn=mse_loss
        )


@pytest.mark.asyncio
async def test_a_failed_run_reshards_and_the_next_run_is_right() -> None:
    mesh = DeviceMesh(pp=2, dp=2)
    stages = sharded_stages(2, mesh)
    x, y = batch(8)
    calls = 0

    def failing_loss(out: Tensor, target: Tensor) -> Tensor:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise RuntimeError("loss exploded")
        return mse_loss(out, target)

    with pytest.raises(PipelineError, match="loss exploded"):
        await run_schedule(
            stages, "gpipe", micro_batch_num=4, inputs=x, targets=y, loss_fn=failing_loss
        )
    shapes = [tuple(p.shape) for s in stages for p in s.parameters]
    assert all(not fsdp_state_of(s.module).unsharded for s in stages)  # type: ignore[union-attr]

    good = await run_schedule(
        stages, "gpipe", micro_batch_num=4, inputs=x, targets=y, loss_fn=mse_loss
    )
    fresh = sharded_stages(2, mesh)
    reference = await run_schedule(
        fresh, "gpipe", micro_batch_num=4, inputs=x, targets=y, loss_fn=mse_loss
    )
    assert good.losses == reference.losses
    assert [tuple(p.shape) for s in stages for p in s.parameters] == shapes
    for index in range(2):
        for a, b in zip(
            full_gradients([s for s in stages if s.stage_index == index]),
            full_gradients([s for s in fresh if s.stage_index == index]),
            strict=True,
        ):
            np.testing.assert_array_equal(a, b)
