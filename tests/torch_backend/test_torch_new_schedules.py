"""torch stages under ZBV and DualPipeV beyond what both backends run
(``tests/both_backends/test_swap_equivalence.py``): the V placement, and FSDP dp=2 under
both V schedules, swap on bit-identical to swap off and equal to one unsplit model.
"""

from __future__ import annotations

import numpy as np
import pytest
from torch_support import (
    Case,
    build_modules,
    full_grads_by_stage,
    make_data,
    run_case,
    sharded_stages,
    unsplit_loss_and_grads,
)

from ppswap.fsdp import DeviceMesh
from ppswap.scheduler.config import ScheduleConfig


def test_v_placement_puts_the_first_and_last_stage_on_rank_0() -> None:
    config = ScheduleConfig(schedule="zbv", pp=3, vpp=2, micro=3)
    assert [config.rank_of(s) for s in range(6)] == [0, 1, 2, 2, 1, 0]
    assert [config.stages_of(r) for r in range(3)] == [(0, 5), (1, 4), (2, 3)]


DP = 2


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "case",
    [Case("zbv", pp=2, stage_num=4, micro=4), Case("dualpipev", pp=2, stage_num=4, micro=4)],
    ids=Case.label,
)
async def test_fsdp_dp2_under_a_v_matches_unsplit(case: Case) -> None:
    """pp=2 x dp=2 with every stage module fully_shard()-ed: full gradients equal the
    unsplit model on the whole batch, swap on/off bit-identical."""
    mesh = DeviceMesh(pp=case.pp, dp=DP)
    x, y = make_data(DP * case.micro)
    results = []
    grads = []
    for swap in (False, True):
        stages = sharded_stages(case.stage_num, mesh)
        results.append(await run_case(stages, case, swap=swap, inputs=x, targets=y))
        grads.append(full_grads_by_stage(stages, case.stage_num))
    base, swapped = results
    assert swapped.losses == base.losses
    for stage_base, stage_swap in zip(*grads, strict=True):
        for g0, g1 in zip(stage_base, stage_swap, strict=True):
            np.testing.assert_array_equal(g0, g1)
    assert sum(r.offloaded_bytes for r in swapped.ranks) > 0
    ref_loss, ref_grads = unsplit_loss_and_grads(build_modules(case.stage_num), x, y)
    assert base.loss == pytest.approx(ref_loss, rel=1e-5)
    for stage_ref, stage_run in zip(ref_grads, grads[0], strict=True):
        for g_ref, g_run in zip(stage_ref, stage_run, strict=True):
            np.testing.assert_allclose(g_run, g_ref.numpy(), rtol=1e-5, atol=1e-6)
