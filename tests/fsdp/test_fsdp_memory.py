"""Measured parameter bytes per rank: about 1/dp between uses, the full size during them."""

from __future__ import annotations

import pytest
from fsdp_support import batch, sharded_stages

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.fsdp import DeviceMesh

# dim 8: every first dimension (16, 8) divides by dp = 2 and 4, so the shards are exact.
DIM = 8


@pytest.mark.asyncio
@pytest.mark.parametrize("dp", [2, 4])
async def test_parameter_bytes_drop_to_one_over_dp_between_uses(dp: int) -> None:
    pp, micro = 2, 2
    x, y = batch(dp * micro, dim=DIM)
    plain = [PipelineStage(m, i, pp) for i, m in enumerate(build_mlp_stages(pp, dim=DIM))]
    baseline = await run_schedule(
        plain,
        "gpipe",
        micro_batch_num=micro,
        inputs=x[:micro],
        targets=y[:micro],
        loss_fn=mse_loss,
    )
    full = [r.resident_param_bytes for r in baseline.ranks]
    # A pp-only rank keeps its whole stage: 2 blocks of (16x8 + 16 + 8x16 + 8) float32.
    assert full == [2 * (16 * 8 + 16 + 8 * 16 + 8) * 4] * pp
    assert [r.peak_param_bytes for r in baseline.ranks] == full

    mesh = DeviceMesh(pp=pp, dp=dp)
    result = await run_schedule(
        sharded_stages(pp, mesh, dim=DIM),
        "gpipe",
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=True,
    )
    assert len(result.ranks) == pp * dp
    for stats in result.ranks:
        full_bytes = full[stats.rank % pp]
        assert stats.unsharded_param_bytes == full_bytes
        assert stats.resident_param_bytes == full_bytes // dp  # between uses: the shard
        # During a use: the full parameters plus the kept shard.
        assert stats.peak_param_bytes == full_bytes + full_bytes // dp
