"""Expert parallelism in a pipeline, torch, every rank in this process: MoE stages split
over the EP group and FSDP-sharded dense parameters give the unsplit model's loss and
each rank's gradients (dense shards after the dp reduction, each expert's on its owner),
with swap bit-identical to swap off, no thread left, and a lower peak of saved bytes.

The ranks share the compute thread, so a MoE leaf runs as a fiber that gives the thread
up while its all-to-all is in flight (``ppswap.core.fiber``): these runs deadlock (and
fail at the step deadline) without it."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import numpy as np
import pytest

from ppswap import PipelineError, PipelineStage, run_schedule
from ppswap.core.faults import FaultPlan, delay_compute, fail_compute
from ppswap.errors import first_pipeline_error
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.moe import expert_parallel
from ppswap.scheduler.steps import StepKind

torch = pytest.importorskip("torch")

from moe_support import (  # noqa: E402
    build_modules,
    check_against_reference,
    ep_stages,
    local_grads,
    make_data,
    mse_loss,
    reference,
)


async def _run(
    stages: list[PipelineStage], pp: int, micro: int, schedule: str, *, swap: bool, **kw: Any
) -> Any:
    x, y = make_data(2 * micro * 2)
    return await run_schedule(
        stages,
        schedule,
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=swap,
        pp=pp,
        step_timeout=60.0,
        **kw,
    )


def _no_thread_left() -> None:
    names = [t.name for t in threading.enumerate() if t.name.startswith("ppswap-")]
    assert sorted(n for n in names if n != "ppswap-torch-dist-wait") == []


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("schedule", "pp", "stage_num", "top_k", "shard_first", "split_dw"),
    [
        ("gpipe", 2, 2, 1, False, False),
        ("gpipe", 2, 2, 2, True, False),
        ("interleaved_1f1b", 2, 4, 2, False, False),
        ("1f1b", 2, 2, 2, False, True),
    ],
)
async def test_pp2_ep2_equals_the_unsplit_model(
    schedule: str, pp: int, stage_num: int, top_k: int, shard_first: bool, split_dw: bool
) -> None:
    mesh = DeviceMesh(pp=pp, dp=2, ep=2)
    stages = ep_stages(stage_num, mesh, top_k, shard_first=shard_first)
    result = await _run(stages, pp, 2 * pp, schedule, swap=False, split_dw=split_dw)
    x, y = make_data(2 * 2 * pp * 2)
    ref_loss, ref_grads = reference(stage_num, top_k, x, y)
    assert result.loss == pytest.approx(ref_loss, rel=1e-5)
    assert check_against_reference(stages, ref_grads) == 2 * stage_num * 7
    _no_thread_left()


@pytest.mark.asyncio
@pytest.mark.parametrize("split_dw", [False, True])
async def test_level1_pp4_ep2_1f1b_overlap_and_swap(split_dw: bool) -> None:
    """The design's Level1 case: PP=4 x EP=2 (eight ranks), 1F1B with overlap_b_f, swap
    on against swap off: the same losses and local gradients bit for bit, both equal to
    the unsplit model, every worker ended, and a lower peak of saved bytes with swap;
    also with the dx/dw split."""
    mesh = DeviceMesh(pp=4, dp=2, ep=2)
    micro = 8
    runs = {}
    for swap in (False, True):
        stages = ep_stages(4, mesh, 2)
        result = await _run(
            stages, 4, micro, "1f1b", swap=swap, overlap_b_f=True, split_dw=split_dw
        )
        runs[swap] = (stages, result)
        _no_thread_left()
    (off_stages, off), (on_stages, on) = runs[False], runs[True]
    assert [r.rank for r in on.ranks] == list(range(8))
    assert on.losses == off.losses
    for stage_off, stage_on in zip(off_stages, on_stages, strict=True):
        grads_off, grads_on = local_grads(stage_off), local_grads(stage_on)
        assert grads_off.keys() == grads_on.keys()
        for name, grad in grads_off.items():
            np.testing.assert_array_equal(grads_on[name], grad, err_msg=name)
    x, y = make_data(2 * micro * 2)
    ref_loss, ref_grads = reference(4, 2, x, y)
    assert on.loss == pytest.approx(ref_loss, rel=1e-5)
    assert check_against_reference(on_stages, ref_grads) == 8 * 7
    assert sum(r.offloaded_bytes for r in on.ranks) > 0
    peak_off = sum(r.peak_saved_bytes for r in off.ranks)
    peak_on = sum(r.peak_saved_bytes for r in on.ranks)
    assert peak_on < peak_off


@pytest.mark.asyncio
async def test_a_moe_stage_without_expert_parallel_is_refused_naming_it() -> None:
    mesh = DeviceMesh(pp=2, dp=2, ep=2)
    stages = []
    for dp_rank in range(2):
        for index, module in enumerate(build_modules(2, 2)):
            fully_shard(module, mesh=mesh, dp_rank=dp_rank)
            stages.append(PipelineStage(module, index, 2))
    with pytest.raises(ValueError, match=r"stage 0 holds MoE blocks but was not split by"):
        await _run(stages, 2, 2, "gpipe", swap=False)


@pytest.mark.asyncio
async def test_a_split_stage_in_a_run_without_ep_is_refused() -> None:
    mesh = DeviceMesh(pp=2, dp=2, ep=2)
    modules = [expert_parallel(m, mesh=mesh, dp_rank=0) for m in build_modules(2, 2)]
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(modules)]
    with pytest.raises(ValueError, match=r"stage 0 was split by expert_parallel with mesh="):
        await _run(stages, 2, 2, "gpipe", swap=False)


@pytest.mark.asyncio
async def test_dp4_ep2_sums_expert_gradients_over_the_replicas_holding_them() -> None:
    """dp=4 > ep=2: two EP groups; each expert lives on two ranks of a pipeline rank,
    whose gradients are summed (and divided by dp) to the unsplit model's."""
    mesh = DeviceMesh(pp=2, dp=4, ep=2)
    stages = ep_stages(2, mesh, 2)
    micro = 2
    x, y = make_data(4 * micro * 2)
    result = await run_schedule(
        stages,
        "1f1b",
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        pp=2,
        step_timeout=60.0,
    )
    ref_loss, ref_grads = reference(2, 2, x, y)
    assert result.loss == pytest.approx(ref_loss, rel=1e-5)
    assert check_against_reference(stages, ref_grads) == 8 * 7
    _no_thread_left()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", [StepKind.FWD, StepKind.BWD])
async def test_a_peer_failing_mid_exchange_ends_the_run_cleanly(kind: StepKind) -> None:
    """Rank 2 (the EP peer of rank 0) fails at a MoE leaf while rank 0's leaf waits for
    it, suspended in its all-to-all: the run raises rank 2's error, and every thread of
    the run (fibers included) is gone once it returned."""
    mesh = DeviceMesh(pp=2, dp=2, ep=2)
    stages = ep_stages(2, mesh, 2)
    plan = FaultPlan((fail_compute(kind, rank=2, stage=0, micro=1),))
    with pytest.raises(PipelineError) as caught:
        await _run(stages, 2, 4, "gpipe", swap=True, faults=plan)
    assert first_pipeline_error(caught.value).rank == 2
    _no_thread_left()


@pytest.mark.asyncio
async def test_cancelling_a_run_during_an_all_to_all_ends_it_cleanly() -> None:
    """Cancelled while rank 0's MoE leaf is suspended in its all-to-all (its peer is
    held back): the run ends at once and leaves no thread."""
    mesh = DeviceMesh(pp=2, dp=2, ep=2)
    stages = ep_stages(2, mesh, 2)
    plan = FaultPlan((delay_compute(2.0, StepKind.FWD, rank=2, stage=0, micro=1),))
    with anyio.move_on_after(0.5) as scope:
        await _run(stages, 2, 4, "gpipe", swap=True, faults=plan)
    assert scope.cancelled_caught
    _no_thread_left()
