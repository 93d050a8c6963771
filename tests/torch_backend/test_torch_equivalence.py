"""torch stages: swap on is bit-identical to swap off, and both equal one unsplit model,
where torch goes beyond the schedule families that both backends run
(``tests/both_backends/test_swap_equivalence.py``): FSDP dp=2 (with the gap rule and the
peak policy), repeated runs of one schedule object, torch tensors as the batch, and
stages without trainable parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from torch import nn
from torch_support import (
    Case,
    build_modules,
    build_stages,
    full_grads_by_stage,
    grads_of,
    make_data,
    mse_loss,
    predictions,
    run_case,
    sharded_stages,
    unsplit_loss_and_grads,
)

from ppswap import PipelineStage, RunResult, ScheduleGPipe
from ppswap.fsdp import DeviceMesh, fsdp_state_of, full_parameters
from ppswap.scheduler.cost import build_orders
from ppswap.scheduler.swap_plan import eligible_chunks

RTOL, ATOL = 1e-5, 1e-6

GPIPE = Case("gpipe", pp=2, stage_num=2, micro=4)


def assert_bit_identical(
    expected: Sequence[Sequence[torch.Tensor]], actual: Sequence[Sequence[torch.Tensor]]
) -> None:
    assert len(expected) == len(actual)
    for index, (stage_e, stage_a) in enumerate(zip(expected, actual, strict=True)):
        assert len(stage_e) == len(stage_a)
        for e, a in zip(stage_e, stage_a, strict=True):
            assert e.dtype == a.dtype == torch.float32
            assert torch.equal(e, a), f"stage {index}: max |d| = {(e - a).abs().max().item()}"


def assert_matches_unsplit(
    stages: Sequence[PipelineStage], result: RunResult, grads: Sequence[Sequence[torch.Tensor]]
) -> None:
    x, y = make_data()
    ordered = sorted(stages, key=lambda s: s.stage_index)
    ref_loss, ref_grads = unsplit_loss_and_grads([s.module for s in ordered], x, y)
    assert result.loss == pytest.approx(ref_loss, rel=RTOL)
    by_index = {s.stage_index: g for s, g in zip(stages, grads, strict=True)}
    for index, stage_ref in enumerate(ref_grads):
        for g_ref, g_run in zip(stage_ref, by_index[index], strict=True):
            assert g_run.shape == g_ref.shape
            torch.testing.assert_close(g_run, g_ref, rtol=RTOL, atol=ATOL)


# -- FSDP dp=2 ------------------------------------------------------------------------------

DP = 2
FSDP_CASES = [
    Case("gpipe", pp=2, stage_num=2, micro=4),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4),
    # pp=2 1F1B swaps nothing (every gap is short): pp=4 does.
    Case("1f1b", pp=4, stage_num=4, micro=8, split_dw=True, overlap_b_f=True),
]


async def _fsdp_run(
    case: Case, swap: bool, swap_policy: str = "gap"
) -> tuple[list[PipelineStage], RunResult]:
    mesh = DeviceMesh(pp=case.pp, dp=DP)
    stages = sharded_stages(case.stage_num, mesh)
    x, y = make_data(DP * case.micro)
    result = await run_case(stages, case, swap=swap, inputs=x, targets=y, swap_policy=swap_policy)
    return stages, result


@pytest.mark.asyncio
@pytest.mark.parametrize("case", FSDP_CASES, ids=Case.label)
async def test_fsdp_dp2_matches_unsplit_and_swap_is_bit_identical(case: Case) -> None:
    """pp x dp=2 with every replica's stage module fully_shard()-ed (the MLP's odd hidden
    size pads some shards): full gradients equal the unsplit model on the whole batch,
    swap on/off bit-identical, the parameters back to unchanged shards."""
    base_stages, base = await _fsdp_run(case, swap=False)
    swap_stages, swapped = await _fsdp_run(case, swap=True)
    assert [r.rank for r in base.ranks] == list(range(case.pp * DP))
    assert swapped.losses == base.losses
    base_grads = full_grads_by_stage(base_stages, case.stage_num)
    swap_grads = full_grads_by_stage(swap_stages, case.stage_num)
    for stage_base, stage_swap in zip(base_grads, swap_grads, strict=True):
        for g0, g1 in zip(stage_base, stage_swap, strict=True):
            np.testing.assert_array_equal(g0, g1)
    plan = predictions(case.config(fsdp=True))
    mesh = DeviceMesh(pp=case.pp, dp=DP)
    for rank, on in enumerate(swapped.ranks):
        # Every dp replica of pipeline rank p runs p's order.
        assert (on.offloaded_bytes > 0) == bool(plan[mesh.coords(rank).pp].eligible)
        assert on.loaded_bytes == on.offloaded_bytes
    assert any(p.eligible for p in plan), "the case must exercise swap"

    reference = build_modules(case.stage_num)
    for index, module in enumerate(reference):
        replicas = [s.module for s in swap_stages if s.stage_index == index]
        states = [fsdp_state_of(m) for m in replicas]
        assert all(state is not None and not state.unsharded for state in states)
        for full, ref in zip(full_parameters(replicas), module.parameters(), strict=True):
            np.testing.assert_array_equal(full, ref.detach().numpy())

    x, y = make_data(DP * case.micro)
    ref_loss, ref_grads = unsplit_loss_and_grads(reference, x, y)
    assert base.loss == pytest.approx(ref_loss, rel=RTOL)
    for stage_ref, stage_run in zip(ref_grads, base_grads, strict=True):
        for g_ref, g_run in zip(stage_ref, stage_run, strict=True):
            assert g_run.shape == tuple(g_ref.shape)
            np.testing.assert_allclose(g_run, g_ref.numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.asyncio
async def test_fsdp_dp2_with_the_peak_policy_equals_the_gap_rule() -> None:
    """``swap_policy="peak"`` on the most composed FSDP case (1F1B pp4 dp2 with split_dw
    and overlap_b_f): the same losses and gradients bit for bit as the gap rule, the same
    measured peaks, and each replica moves exactly its pipeline rank's chosen chunks."""
    case = FSDP_CASES[-1]
    gap_stages, gap = await _fsdp_run(case, swap=True)
    peak_stages, peak = await _fsdp_run(case, swap=True, swap_policy="peak")
    assert peak.losses == gap.losses
    for stage_gap, stage_peak in zip(
        full_grads_by_stage(gap_stages, case.stage_num),
        full_grads_by_stage(peak_stages, case.stage_num),
        strict=True,
    ):
        for g0, g1 in zip(stage_gap, stage_peak, strict=True):
            np.testing.assert_array_equal(g0, g1)
    assert [r.peak_saved_bytes for r in peak.ranks] == [r.peak_saved_bytes for r in gap.ranks]
    chosen = [len(eligible_chunks(order)) for order in build_orders(case.config(fsdp=True), "peak")]
    mesh = DeviceMesh(pp=case.pp, dp=DP)
    for rank, on in enumerate(peak.ranks):
        assert on.copies == 2 * chosen[mesh.coords(rank).pp]
    assert sum(r.offloaded_bytes for r in peak.ranks) < sum(r.offloaded_bytes for r in gap.ranks)


# -- repeated runs ----------------------------------------------------------------------------


def test_a_schedule_object_run_twice_gives_the_same_result() -> None:
    """ScheduleGPipe run twice on the same stages (swap on): the same losses and gradients,
    bit for bit; the gradients are reset per run (not accumulated: a second run would
    double them) and equal those of fresh stages."""
    stages = build_stages(2)
    schedule = ScheduleGPipe(stages, micro_batch_num=4, loss_fn=mse_loss, swap=True)
    x, y = make_data()
    first = schedule.run(x, targets=y)
    first_grads = grads_of(stages)
    second = schedule.run(x, targets=y)
    assert second.losses == first.losses
    assert_bit_identical(first_grads, grads_of(stages))
    assert all(r.offloaded_bytes > 0 for r in second.ranks)

    fresh = build_stages(2)
    fresh_result = ScheduleGPipe(fresh, micro_batch_num=4, loss_fn=mse_loss).run(x, targets=y)
    assert fresh_result.losses == first.losses
    assert_bit_identical(grads_of(fresh), first_grads)


@pytest.mark.asyncio
async def test_torch_tensor_batches_equal_numpy_batches() -> None:
    """inputs/targets given as torch tensors give the same run as numpy arrays."""
    x, y = make_data()
    from_numpy = build_stages(2)
    a = await run_case(from_numpy, GPIPE, swap=True)
    from_torch = build_stages(2)
    b = await run_case(
        from_torch, GPIPE, swap=True, inputs=torch.from_numpy(x), targets=torch.from_numpy(y)
    )
    assert a.losses == b.losses
    assert_bit_identical(grads_of(from_numpy), grads_of(from_torch))


class _Activation(nn.Module):
    """A stage with no parameters at all."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2.0


@pytest.mark.asyncio
@pytest.mark.parametrize("split_dw", [False, True], ids=["bwd", "dx-dw"])
async def test_stages_without_trainable_parameters(split_dw: bool) -> None:
    """A parameter-free stage and a frozen stage (requires_grad False) between trainable
    ones: with and without the dx/dw split (whose BWD_WEIGHT then has no weight to
    differentiate) the run equals the unsplit model, swap on bit-identical to off."""

    def modules() -> list[nn.Module]:
        first, frozen, last = build_modules(3)
        frozen.requires_grad_(False)
        return [first, _Activation(), frozen, last]

    case = Case("1f1b", pp=4, stage_num=4, micro=8, split_dw=split_dw)
    runs = []
    for swap in (False, True):
        stages = [PipelineStage(m, i, 4) for i, m in enumerate(modules())]
        runs.append((stages, await run_case(stages, case, swap=swap)))
    (base_stages, base), (swap_stages, swapped) = runs
    assert [len(s.parameters) for s in base_stages] == [10, 0, 0, 10]
    assert swapped.losses == base.losses
    assert_bit_identical(grads_of(base_stages), grads_of(swap_stages))
    assert swapped.ranks[0].offloaded_bytes > 0
    assert_matches_unsplit(base_stages, base, grads_of(base_stages))
