"""The MindSpore MoE block's load-balancing loss (``aux_loss_coef``), as the torch one:
its gradient is added in the block's backward (``AuxGrad``'s bprop), scaled like the
loss, per micro-batch chunk over the block's own tokens, so every gradient (the
router's among them) equals the unsplit model's with each chunk's term added to its
loss (rtol 1e-5); each rank reports its blocks' term. With expert parallelism (one
process per rank): ``test_moe_mindspore.py``'s MPI run.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.mindspore

ms = pytest.importorskip("mindspore")

from moe_support_ms import (  # noqa: E402
    DIM,
    EXPERTS,
    build_modules,
    chunked_reference,
    make_data,
    mse_loss,
)

from ppswap import PipelineStage, run_schedule  # noqa: E402
from ppswap.backends.mindspore.moe import MoE  # noqa: E402

COEF = 0.5


@pytest.mark.asyncio
@pytest.mark.parametrize("swap", [False, True])
async def test_aux_gradient_reaches_the_router(swap: bool) -> None:
    micro, batch = 4, 8
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(build_modules(2, 2, aux_loss_coef=COEF))]
    x, y = make_data(batch)
    result = await run_schedule(
        stages,
        "1f1b",
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=swap,
        step_timeout=60.0,
    )
    ref_aux, ref = chunked_reference(2, 2, x, y, micro, COEF)
    _, plain = chunked_reference(2, 2, x, y, micro, 0.0)
    routers = 0
    for stage in stages:
        names = [p.name for p in stage.parameters]
        for name, got, want, without in zip(
            names, stage.grads, ref[stage.stage_index], plain[stage.stage_index], strict=True
        ):
            np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-5, atol=1e-6, err_msg=name)
            if "router" in name:  # the term moves it far beyond the tolerance
                routers += 1
                assert np.abs(want - without).max() > 100 * (1e-5 * np.abs(want).max() + 1e-6)
    assert routers == 2
    assert sum(r.aux_loss for r in result.ranks) == pytest.approx(ref_aux, rel=1e-5)


def test_off_by_default_and_refused_when_bad() -> None:
    ms.set_seed(0)
    block = MoE(DIM, 2 * DIM, EXPERTS)
    block(ms.Tensor(np.ones((3, DIM), np.float32)))
    assert block.aux_loss_coef == 0.0 and block.aux_loss is None
    with pytest.raises(ValueError, match=r"aux_loss_coef must be a finite number >= 0"):
        MoE(DIM, 2 * DIM, EXPERTS, aux_loss_coef=-1.0)
