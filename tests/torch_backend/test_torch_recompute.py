"""Recompute on torch (``recompute_wrapper``, ``recompute=True``): a recomputed chunk drops
what its wrapped blocks save after its FWD and regenerates it at its RECOMPUTE step.

Every run is compared with the same stages run without recompute: losses and gradients
bit-identical, with dropout in the recomputed blocks (the forward's generator states are
restored for the re-run). Covered: GPipe, 1F1B with overlap_b_f (a RECOMPUTE of one
micro-batch right before the composite that runs a FWD of another), overlap_b_f with
split_dw (BWD_WEIGHT reads the regenerated tensors), Interleaved, P2P batch and boundary,
FSDP, swap and recompute in one run (different blocks; the same block wrapped by both, in
either order); the measured peak of saved bytes is lower; bad input refused; a fault and
a cancellation at a RECOMPUTE step, and the next run on the same stages identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
import torch
from torch import nn
from torch_support import AttentionBlock, Case, grads_of, run_case

from ppswap import PipelineError, PipelineStage, RunResult, StepKind, recompute_wrapper
from ppswap.core.faults import FaultPlan, call_at, fail_compute
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.swap import swap_wrapper

Wrap = Callable[[nn.Module], nn.Module]


class DropMLP(nn.Module):
    """``x + fc2(dropout(tanh(fc1(x))))``: random numbers in the recomputed block."""

    def __init__(self, dim: int = 8, hidden: int = 15) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update: torch.Tensor = self.fc2(self.drop(torch.tanh(self.fc1(x))))
        return x + update


def plain(module: nn.Module) -> nn.Module:
    return module


def recompute_swap(module: nn.Module) -> nn.Module:
    wrapped: nn.Module = recompute_wrapper(swap_wrapper(module))
    return wrapped


def swap_recompute(module: nn.Module) -> nn.Module:
    wrapped: nn.Module = swap_wrapper(recompute_wrapper(module))
    return wrapped


def modules(stage_num: int, attention: Wrap, mlp: Wrap) -> list[nn.Module]:
    """Stage modules (attention then a dropout MLP), the same weights whatever the wraps."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        built = [(AttentionBlock(), DropMLP()) for _ in range(stage_num)]
    return [nn.Sequential(attention(a), mlp(m)) for a, m in built]


def stages_of(case: Case, attention: Wrap, mlp: Wrap) -> list[PipelineStage]:
    return [
        PipelineStage(m, i, case.stage_num)
        for i, m in enumerate(modules(case.stage_num, attention, mlp))
    ]


async def run(stages: list[PipelineStage], case: Case, **options: Any) -> RunResult:
    torch.manual_seed(5)
    swap = options.pop("swap", False)
    return await run_case(stages, case, swap=swap, **options)


def assert_same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        assert all(torch.equal(g, h) for g, h in zip(left, right, strict=True))


CASES = [
    Case("gpipe", pp=2, stage_num=2, micro=4),
    Case("1f1b", pp=2, stage_num=2, micro=4, overlap_b_f=True),
    Case("1f1b", pp=2, stage_num=2, micro=4, overlap_b_f=True, split_dw=True),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4),
    Case("1f1b", pp=2, stage_num=2, micro=4, p2p="batch"),
    Case("1f1b", pp=2, stage_num=2, micro=4, p2p="boundary"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c.schedule}-{c.p2p}-o{c.overlap_b_f:d}-s{c.split_dw:d}"
)
async def test_recompute_is_bit_identical_with_dropout_and_lowers_the_peak(case: Case) -> None:
    base_stages = stages_of(case, plain, plain)
    base = await run(base_stages, case)
    stages = stages_of(case, recompute_wrapper, recompute_wrapper)
    result = await run(stages, case, recompute=True)
    assert result.losses == base.losses
    assert_same(grads_of(stages), grads_of(base_stages))
    # every chunk recomputed, its RECOMPUTE run once
    for rank in result.ranks:
        assert set(rank.chunk_policy.values()) == {"recompute"}
        assert rank.compute_jobs["recompute"] == len(rank.chunk_policy)
    # the first rank's chunks wait longest for their backward: its peak goes down
    assert result.ranks[0].peak_saved_bytes < base.ranks[0].peak_saved_bytes
    assert all(r.saved_bytes_left == 0 for r in result.ranks)
    # dropout is active: the same stages in eval mode give other losses
    for stage in stages:
        stage.module.eval()
    assert (await run(stages, case, recompute=True)).losses != base.losses


@pytest.mark.asyncio
async def test_recompute_under_fsdp_follows_the_unshard_and_is_bit_identical() -> None:
    case, mesh = Case("1f1b", pp=2, stage_num=2, micro=4, overlap_b_f=True), DeviceMesh(pp=2, dp=2)

    def sharded(wrap: Wrap) -> list[PipelineStage]:
        out = []
        for dp_rank in range(mesh.dp):
            for index, module in enumerate(modules(case.stage_num, wrap, wrap)):
                fully_shard(module, mesh=mesh, dp_rank=dp_rank)
                out.append(PipelineStage(module, index, case.stage_num))
        return out

    base_stages, stages = sharded(plain), sharded(recompute_wrapper)
    base = await run(base_stages, case, mesh=mesh)
    result = await run(stages, case, mesh=mesh, recompute=True)
    assert result.losses == base.losses
    assert_same(grads_of(stages), grads_of(base_stages))
    assert result.ranks[0].peak_saved_bytes < base.ranks[0].peak_saved_bytes


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:swap=True moved nothing")  # recompute won for every block
@pytest.mark.parametrize(
    ("attention", "mlp", "policies"),
    [
        (swap_wrapper, recompute_wrapper, {"recompute+swap"}),  # different blocks
        (recompute_swap, recompute_swap, {"recompute+swap"}),  # one block wrapped by both
        (swap_recompute, swap_recompute, {"recompute+swap"}),  # ... in the other order
    ],
    ids=["different-blocks", "recompute(swap)", "swap(recompute)"],
)
async def test_swap_and_recompute_in_one_run(
    attention: Wrap, mlp: Wrap, policies: set[str]
) -> None:
    case = Case("gpipe", pp=2, stage_num=2, micro=4)
    base_stages = stages_of(case, plain, plain)
    base = await run(base_stages, case)
    stages = stages_of(case, attention, mlp)
    result = await run(stages, case, swap=True, recompute=True)
    assert result.losses == base.losses
    assert_same(grads_of(stages), grads_of(base_stages))
    first = result.ranks[0]
    assert set(first.chunk_policy.values()) == policies
    both_wrapped = attention is mlp
    # recompute wins for a block wrapped by both: nothing of it moves
    assert (first.offloaded_bytes == 0) == both_wrapped
    assert first.peak_saved_bytes < base.ranks[0].peak_saved_bytes
    # swap alone on the same stages moves the recompute-wrapped blocks too
    alone = await run(stages, case, swap=True)
    assert alone.losses == base.losses
    if both_wrapped:
        assert alone.ranks[0].offloaded_bytes > 0


@pytest.mark.asyncio
async def test_bad_recompute_input_is_refused_before_anything_runs() -> None:
    case = Case("gpipe", pp=2, stage_num=2, micro=4)
    with pytest.raises(ValueError, match="recompute=True needs a stage with a recompute_wrapper"):
        await run(stages_of(case, plain, plain), case, recompute=True)
    with pytest.raises(ValueError, match="recompute must be False for a forward-only run"):
        await run(
            stages_of(case, recompute_wrapper, plain), case, recompute=True, forward_only=True
        )
    with pytest.raises(TypeError, match="recompute must be a bool"):
        await run(stages_of(case, recompute_wrapper, plain), case, recompute=1)
    with pytest.raises(TypeError, match=r"recompute_wrapper\(module=...\)"):
        recompute_wrapper(lambda x: x)


@pytest.mark.asyncio
async def test_a_fault_at_a_recompute_step_then_the_same_stages_run_again() -> None:
    case = Case("1f1b", pp=2, stage_num=2, micro=4, overlap_b_f=True)
    base_stages = stages_of(case, plain, plain)
    base = await run(base_stages, case)
    stages = stages_of(case, recompute_wrapper, recompute_wrapper)
    plan = FaultPlan((fail_compute(StepKind.RECOMPUTE, rank=0, stage=0, micro=1),))
    with pytest.raises(PipelineError, match=r"step R1\.0"):
        await run(stages, case, recompute=True, faults=plan)
    again = await run(stages, case, recompute=True)
    assert again.losses == base.losses
    assert_same(grads_of(stages), grads_of(base_stages))
    assert all(r.saved_bytes_left == 0 and r.groups_left == 0 for r in again.ranks)


@pytest.mark.asyncio
@pytest.mark.parametrize("micro", [0, 2])
async def test_a_cancellation_at_a_recompute_step_then_the_same_stages_run_again(
    micro: int,
) -> None:
    case = Case("1f1b", pp=2, stage_num=2, micro=4, overlap_b_f=True, split_dw=True)
    base_stages = stages_of(case, plain, plain)
    base = await run(base_stages, case)
    stages = stages_of(case, recompute_wrapper, recompute_wrapper)
    with anyio.CancelScope() as scope:
        plan = FaultPlan((call_at(scope.cancel, StepKind.RECOMPUTE, rank=1, stage=1, micro=micro),))
        await run(stages, case, recompute=True, faults=plan)
    assert scope.cancelled_caught
    again = await run(stages, case, recompute=True)
    assert again.losses == base.losses
    assert_same(grads_of(stages), grads_of(base_stages))


def test_recompute_wrapper_is_transparent_outside_a_run() -> None:
    torch.manual_seed(0)
    block = DropMLP().eval()
    wrapped = recompute_wrapper(block)
    x = torch.randn(2, 4, 8)
    assert torch.equal(wrapped(x), block(x))
    assert [p is q for p, q in zip(wrapped.parameters(), block.parameters(), strict=True)] == [
        True
    ] * 4
