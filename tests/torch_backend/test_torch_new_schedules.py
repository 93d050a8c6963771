"""torch stages under Looped BFS, Interleaved Zero Bubble, ZBV and DualPipeV: swap on is
bit-identical to swap off, and both equal one unsplit model.

In process, CPU, float32, on the attention + MLP stages of ``torch_support`` (both
swap-wrapped). The V schedules place stage ``s`` on rank ``s`` and ``2 * pp - 1 - s``
(rank 0 runs the first and the last stage; the last rank hands its first-leg output to
itself at the V's turn). Per rank, swap moves bytes exactly where the plan swaps, loads
them all back and lowers the measured peak where the plan predicts a cut. Then FSDP dp=2
under both V schedules.
"""

from __future__ import annotations

import numpy as np
import pytest
from stage_runs import stage_runs_holding_chunks
from test_torch_equivalence import assert_bit_identical, assert_matches_unsplit
from torch_support import (
    Case,
    build_modules,
    build_stages,
    full_grads_by_stage,
    grads_of,
    make_data,
    predictions,
    run_case,
    sharded_stages,
    unsplit_loss_and_grads,
)

from ppswap.fsdp import DeviceMesh
from ppswap.scheduler.config import ScheduleConfig

CASES = [
    Case("looped_bfs", pp=2, stage_num=4, micro=4),
    Case("interleaved_zb", pp=2, stage_num=4, micro=4),
    Case("interleaved_zb", pp=2, stage_num=4, micro=4, p2p="batch"),
    Case("zbv", pp=2, stage_num=4, micro=4),
    Case("zbv", pp=2, stage_num=4, micro=2, p2p="boundary"),  # micro < 2 * pp - 1
    Case("zbv", pp=4, stage_num=8, micro=8, p2p="batch"),
    Case("dualpipev", pp=2, stage_num=4, micro=4),
    Case("dualpipev", pp=3, stage_num=6, micro=8, p2p="batch"),
    Case("dualpipev", pp=4, stage_num=8, micro=8, p2p="boundary"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=Case.label)
async def test_swap_is_bit_identical_and_matches_unsplit(case: Case) -> None:
    base_stages = build_stages(case.stage_num)
    base = await run_case(base_stages, case, swap=False)
    swap_stages = build_stages(case.stage_num)
    swapped = await run_case(swap_stages, case, swap=True)

    assert len(base.losses) == case.micro
    assert swapped.losses == base.losses  # bit-identical floats
    base_grads, swap_grads = grads_of(base_stages), grads_of(swap_stages)
    assert_bit_identical(base_grads, swap_grads)
    assert_matches_unsplit(base_stages, base, base_grads)

    plan = predictions(case.config())
    assert any(p.eligible for p in plan), "the case must exercise swap"
    for p, off, on in zip(plan, base.ranks, swapped.ranks, strict=True):
        assert off.offloaded_bytes == off.loaded_bytes == 0
        assert (on.offloaded_bytes > 0) == bool(p.eligible), p
        assert on.loaded_bytes == on.offloaded_bytes
        assert on.groups_left == on.saved_bytes_left == 0
        if p.cuts_peak:
            assert on.peak_saved_bytes < off.peak_saved_bytes, p
    assert stage_runs_holding_chunks() == 0


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
