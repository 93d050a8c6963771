"""``loss_scale`` on both backends: the backward inside the pipeline is seeded with
``loss_scale / micro_batch_num``, so a power-of-two scale multiplies every gradient
exactly (bit for bit, swap on, in three schedule families, with the dx/dw split and
overlap) and leaves the losses alone (torch's ``GradScaler`` recipe and overflow:
``tests/torch_backend/test_torch_loss_scale.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from backend_runs import runs_of

from ppswap import run_schedule

SCALE = 1024.0
CASES = {
    # name: (schedule, pp, stage_num, micro, options)
    "gpipe-pp2": ("gpipe", 2, 2, 4, {}),
    "1f1b-pp4-dw": ("1f1b", 4, 4, 8, {"split_dw": True}),
    "interleaved-pp2-dw-overlap": (
        "interleaved_1f1b",
        2,
        4,
        4,
        {"split_dw": True, "overlap_b_f": True},
    ),
}


@pytest.mark.timeout(120)
@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CASES))
async def test_loss_scale_multiplies_every_gradient_exactly(backend: str, case: str) -> None:
    runs = runs_of(backend)
    schedule, pp, stage_num, micro, options = CASES[case]
    results = []
    for loss_scale in (1.0, SCALE):
        stages = runs.stages(stage_num)
        x, y = runs.data()
        result = await run_schedule(
            stages,
            schedule,
            pp=pp,
            micro_batch_num=micro,
            inputs=x,
            targets=y,
            loss_fn=runs.loss_fn,
            swap=True,
            loss_scale=loss_scale,
            step_timeout=60.0,
            **options,
        )
        results.append((result, runs.grads(stages)))
    (plain, grads), (scaled, scaled_grads) = results
    assert scaled.losses == plain.losses
    assert sum(r.offloaded_bytes for r in scaled.ranks) > 0
    for stage_grads, stage_scaled in zip(grads, scaled_grads, strict=True):
        assert len(stage_grads) == len(stage_scaled)
        for grad, scaled_grad in zip(stage_grads, stage_scaled, strict=True):
            assert scaled_grad.dtype == grad.dtype
            assert np.array_equal(scaled_grad, grad * np.float32(SCALE))
