"""Swap beside MindSpore's recomputation (``Cell.recompute()``).

A stage whose cell recomputes its swap-wrapped blocks in the backward keeps nothing of
them between its forward and its backward, swap on or off: swap must neither keep (and
move) what recomputation drops nor change a number. Interleaved pp2 in one process: the
same peak saved bytes and no byte moved with swap on, bit-identical to swap off; without
recomputation swap moves bytes and lowers the peak (the case exercises swap). The torch
counterpart (``torch.utils.checkpoint``) is ``tests/torch_backend/test_torch_checkpoint.py``.
"""

from __future__ import annotations

import numpy as np
import pytest

from ppswap import PipelineStage, RankStats, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.swap import swap_wrapper


async def run(
    *, swap: bool, recompute: bool
) -> tuple[list[float], list[RankStats], list[np.ndarray]]:
    modules = build_mlp_stages(4, wrap=swap_wrapper)
    if recompute:
        for module in modules:
            module.recompute()
    stages = [PipelineStage(m, i, 4) for i, m in enumerate(modules)]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.standard_normal((8, 16)).astype(np.float32)
    result = await run_schedule(
        stages,
        "interleaved_1f1b",
        micro_batch_num=4,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=swap,
        pp=2,
        step_timeout=60,
    )
    return result.losses, result.ranks, [g.asnumpy() for s in stages for g in s.grads]


@pytest.mark.asyncio
async def test_recomputed_swap_wrapped_blocks_keep_nothing_and_move_nothing() -> None:
    off = await run(swap=False, recompute=True)
    on = await run(swap=True, recompute=True)
    assert on[0] == off[0]
    assert all(np.array_equal(a, b) for a, b in zip(off[2], on[2], strict=True))
    for rank_off, rank_on in zip(off[1], on[1], strict=True):
        assert rank_on.offloaded_bytes == 0
        assert rank_on.peak_saved_bytes == rank_off.peak_saved_bytes

    plain_off = await run(swap=False, recompute=False)
    plain_on = await run(swap=True, recompute=False)
    assert sum(r.offloaded_bytes for r in plain_on[1]) > 0
    assert plain_on[1][0].peak_saved_bytes < plain_off[1][0].peak_saved_bytes
    assert off[1][0].peak_saved_bytes < plain_off[1][0].peak_saved_bytes  # recomputation kept less
