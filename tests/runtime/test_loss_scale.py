"""``loss_scale`` on MindSpore: the backward seeded with ``loss_scale / micro_batch_num``,
so a power-of-two scale multiplies every gradient exactly (swap on, 1F1B with dx/dw
split) and leaves the losses alone (the torch twin, with ``GradScaler``:
``tests/torch_backend/test_torch_loss_scale.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.swap import swap_wrapper

SCALE = 1024.0


async def run(loss_scale: float) -> tuple[list[float], list[np.ndarray], int]:
    stages = [
        PipelineStage(m, i, 4)
        for i, m in enumerate(build_mlp_stages(4, dim=8, wrap=swap_wrapper, seed=0))
    ]
    rng = np.random.default_rng(1)
    x, y = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
    result = await run_schedule(
        stages,
        "1f1b",
        micro_batch_num=8,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=True,
        split_dw=True,
        loss_scale=loss_scale,
        step_timeout=60.0,
    )
    grads = [g.asnumpy() for stage in stages for g in stage.grads]
    return list(result.losses), grads, sum(r.offloaded_bytes for r in result.ranks)


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_loss_scale_multiplies_every_gradient_exactly() -> None:
    losses, grads, _ = await run(1.0)
    scaled_losses, scaled_grads, moved = await run(SCALE)
    assert scaled_losses == losses and moved > 0
    for grad, scaled in zip(grads, scaled_grads, strict=True):
        assert np.array_equal(scaled, grad * np.float32(SCALE))
