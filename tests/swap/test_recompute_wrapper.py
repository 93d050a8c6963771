"""Recompute on MindSpore (``recompute_wrapper``, ``recompute=True``): a recomputed chunk
drops what its wrapped blocks save after its FWD and regenerates it at its RECOMPUTE step
(MindSpore's own non-reentrant re-run: an empty top graph, saved-tensor hooks).

Each run is compared with the same stages without recompute: losses and gradients
bit-identical on GPipe, 1F1B with overlap_b_f (with and without split_dw), Interleaved,
P2P batch and boundary, FSDP dp2, and with swap in the same run (different blocks, the
same block wrapped by both in either order); the measured peak of saved bytes is lower;
a fault and a cancellation at a RECOMPUTE step, and the next run on the same stages is
identical. (Dropout: MindSpore's CPU kernels have no generator-driven dropout, and
``nn.Dropout`` keeps per-operator states no generator state restores: its
bit-identity under recompute is tested on torch, ``tests/torch_backend``.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest
from mindspore import nn

from ppswap import (
    PipelineError,
    PipelineStage,
    RunResult,
    StepKind,
    recompute_wrapper,
    run_schedule,
)
from ppswap.core.faults import FaultPlan, call_at, fail_compute
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.swap import swap_wrapper

Wrap = Callable[[nn.Cell], nn.Cell]


@dataclass(frozen=True)
class Case:
    schedule: str = "gpipe"
    stage_num: int = 2
    pp: int = 2
    micro: int = 4
    overlap_b_f: bool = False
    split_dw: bool = False
    p2p: str = "plain"


def plain(cell: nn.Cell) -> nn.Cell:
    return cell


def stages_of(
    case: Case, first: Wrap, second: Wrap, *, mesh: DeviceMesh | None = None
) -> list[PipelineStage]:
    out: list[PipelineStage] = []
    for dp_rank in range(1 if mesh is None else mesh.dp):
        modules = build_mlp_stages(case.stage_num)
        for index, module in enumerate(modules):
            blocks = list(module.cell_list)
            wrapped = nn.SequentialCell([first(blocks[0]), second(blocks[1])])
            if mesh is not None:
                fully_shard(wrapped, mesh=mesh, dp_rank=dp_rank)
            out.append(PipelineStage(wrapped, index, case.stage_num))
    return out


def data(batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((batch, 16)).astype(np.float32)
    y = rng.standard_normal((batch, 16)).astype(np.float32)
    return x, y


async def run(stages: list[PipelineStage], case: Case, **options: Any) -> RunResult:
    x, y = data()
    return await run_schedule(
        list(stages),
        case.schedule,
        micro_batch_num=case.micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        pp=case.pp,
        overlap_b_f=case.overlap_b_f,
        split_dw=case.split_dw,
        p2p=case.p2p,
        step_timeout=60.0,
        **options,
    )


def grads(stages: list[PipelineStage]) -> list[list[np.ndarray]]:
    return [[g.asnumpy().copy() for g in stage.grads] for stage in stages]


def assert_same(a: list[list[np.ndarray]], b: list[list[np.ndarray]]) -> None:
    assert len(a) == len(b)
    for left, right in zip(a, b, strict=True):
        assert all(np.array_equal(g, h) for g, h in zip(left, right, strict=True))


CASES = [
    Case("gpipe"),
    Case("1f1b", overlap_b_f=True),
    Case("1f1b", overlap_b_f=True, split_dw=True),
    Case("interleaved_1f1b", stage_num=4),
    Case("1f1b", p2p="batch"),
    Case("1f1b", p2p="boundary"),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"{c.schedule}-{c.p2p}-o{c.overlap_b_f:d}-s{c.split_dw:d}"
)
async def test_recompute_is_bit_identical_and_lowers_the_peak(case: Case) -> None:
    base_stages = stages_of(case, plain, plain)
    base = await run(base_stages, case)
    stages = stages_of(case, recompute_wrapper, recompute_wrapper)
    result = await run(stages, case, recompute=True)
    assert result.losses == base.losses
    assert_same(grads(stages), grads(base_stages))
    for rank in result.ranks:
        assert set(rank.chunk_policy.values()) == {"recompute"}
        assert rank.compute_jobs["recompute"] == len(rank.chunk_policy)
        assert rank.saved_bytes_left == 0
    assert result.ranks[0].peak_saved_bytes < base.ranks[0].peak_saved_bytes


@pytest.mark.asyncio
async def test_recompute_under_fsdp_is_bit_identical() -> None:
    case, mesh = Case("1f1b", overlap_b_f=True), DeviceMesh(pp=2, dp=2)
    base_stages = stages_of(case, plain, plain, mesh=mesh)
    base = await run(base_stages, case, mesh=mesh)
    stages = stages_of(case, recompute_wrapper, recompute_wrapper, mesh=mesh)
    result = await run(stages, case, mesh=mesh, recompute=True)
    assert result.losses == base.losses
    assert_same(grads(stages), grads(base_stages))
    assert result.ranks[0].peak_saved_bytes < base.ranks[0].peak_saved_bytes


def both(cell: nn.Cell) -> nn.Cell:
    wrapped: nn.Cell = recompute_wrapper(swap_wrapper(cell))
    return wrapped


def both_other_order(cell: nn.Cell) -> nn.Cell:
    wrapped: nn.Cell = swap_wrapper(recompute_wrapper(cell))
    return wrapped


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:swap=True moved nothing")  # recompute won for every block
@pytest.mark.parametrize(
    ("first", "second"),
    [(swap_wrapper, recompute_wrapper), (both, both), (both_other_order, both_other_order)],
    ids=["different-blocks", "recompute(swap)", "swap(recompute)"],
)
async def test_swap_and_recompute_in_one_run(first: Wrap, second: Wrap) -> None:
    case = Case("gpipe")
    base_stages = stages_of(case, plain, plain)
    base = await run(base_stages, case)
    stages = stages_of(case, first, second)
    result = await run(stages, case, swap=True, recompute=True)
    assert result.losses == base.losses
    assert_same(grads(stages), grads(base_stages))
    head = result.ranks[0]
    assert set(head.chunk_policy.values()) == {"recompute+swap"}
    assert (head.offloaded_bytes > 0) == (first is swap_wrapper)  # recompute wins
    assert head.peak_saved_bytes < base.ranks[0].peak_saved_bytes


@pytest.mark.asyncio
async def test_a_fault_and_a_cancellation_at_a_recompute_step_then_the_same_stages_run_again() -> (
    None
):
    case = Case("1f1b", overlap_b_f=True, split_dw=True)
    base_stages = stages_of(case, plain, plain)
    base = await run(base_stages, case)
    stages = stages_of(case, recompute_wrapper, recompute_wrapper)
    plan = FaultPlan((fail_compute(StepKind.RECOMPUTE, rank=0, stage=0, micro=1),))
    with pytest.raises(PipelineError, match=r"step R1\.0"):
        await run(stages, case, recompute=True, faults=plan)
    with anyio.CancelScope() as scope:
        cancel = FaultPlan((call_at(scope.cancel, StepKind.RECOMPUTE, rank=1, stage=1, micro=2),))
        await run(stages, case, recompute=True, faults=cancel)
    assert scope.cancelled_caught
    again = await run(stages, case, recompute=True)
    assert again.losses == base.losses
    assert_same(grads(stages), grads(base_stages))
    assert all(r.saved_bytes_left == 0 and r.groups_left == 0 for r in again.ranks)


@pytest.mark.asyncio
async def test_recompute_without_a_wrapped_block_is_refused() -> None:
    with pytest.raises(ValueError, match="recompute=True needs a stage with a recompute_wrapper"):
        await run(stages_of(Case(), plain, plain), Case(), recompute=True)


class _DropoutBlock(nn.Cell):  # type: ignore[misc]
    def __init__(self, p: float) -> None:
        super().__init__()
        self.fc, self.drop = nn.Dense(4, 4), nn.Dropout(p=p)

    def construct(self, x: Any) -> Any:
        return self.drop(self.fc(x))


def test_a_block_whose_dropout_masks_cannot_be_replayed_is_refused() -> None:
    """MindSpore's nn.Dropout keeps per-operator states no generator state restores: a
    recomputed block would train on other masks than its forward's, so wrapping one is
    refused in one line naming it; a dropout that drops nothing is fine."""
    with pytest.raises(ValueError, match=r"nn\.Dropout 'drop' with p=0\.1.*cannot replay"):
        recompute_wrapper(_DropoutBlock(0.1))
    recompute_wrapper(_DropoutBlock(0.0))
