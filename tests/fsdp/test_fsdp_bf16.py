"""FSDP dp=2 on bfloat16 MindSpore stages (in one process).

The shards, their gradients and the dp reduction travel as numpy bfloat16: MindSpore's
own type, summed as ``ml_dtypes``' (``sum_contributions``) and divided by dp in the
shard's own type. The model is ``tests/mpi/scripts/pipeline_data.py``'s elementwise one
(MindSpore's CPU kernels reduce no bfloat16). GPipe pp2 x dp2 with swap on is
bit-identical to swap off and moves bytes. The torch counterpart is in
``tests/torch_backend/test_torch_bfloat16.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.fsdp import DeviceMesh, full_gradients, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "mpi" / "scripts"))
from pipeline_data import BATCH, bf16_data, bf16_loss, bf16_stages

DP, MICRO = 2, 4


async def run(swap: bool) -> tuple[RunResult, list[list[np.ndarray]]]:
    mesh = DeviceMesh(pp=2, dp=DP)
    stages = []
    for dp_rank in range(DP):
        for index, module in enumerate(bf16_stages(2, rows=BATCH // (DP * MICRO))):
            fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            stages.append(PipelineStage(module, index, 2))
    x, y = bf16_data()
    result = await run_schedule(
        stages,
        "gpipe",
        micro_batch_num=MICRO,
        inputs=x,
        targets=y,
        loss_fn=bf16_loss,
        swap=swap,
        mesh=mesh,
        step_timeout=60,
    )
    full = [full_gradients([s for s in stages if s.stage_index == i]) for i in range(2)]
    return result, full


@pytest.mark.asyncio
async def test_fsdp_dp2_on_bfloat16_stages_swaps_bit_identically() -> None:
    off, off_grads = await run(swap=False)
    on, on_grads = await run(swap=True)
    assert on.losses == off.losses
    assert sum(r.offloaded_bytes for r in on.ranks) > 0
    for stage_off, stage_on in zip(off_grads, on_grads, strict=True):
        for g_off, g_on in zip(stage_off, stage_on, strict=True):
            assert g_off.dtype.name == "bfloat16" and g_off.tobytes() == g_on.tobytes()
