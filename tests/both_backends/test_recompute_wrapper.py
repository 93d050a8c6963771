"""Recompute on each backend (``recompute_wrapper``, ``recompute=True``): a recomputed chunk
drops what its wrapped blocks save after its FWD and regenerates it at its RECOMPUTE step.

Per backend (``backend``: MindSpore, marked ``mindspore``; torch) every run is compared
with the same stages run without recompute: losses and gradients bit-identical. Covered:
GPipe, 1F1B with overlap_b_f (a RECOMPUTE of one micro-batch right before the composite
that runs a FWD of another), overlap_b_f with split_dw (BWD_WEIGHT reads the regenerated
tensors), Interleaved, P2P batch and boundary, FSDP dp2, swap and recompute in one run
(different blocks; the same block wrapped by both, in either order); the measured peak of
saved bytes is lower; nothing of a run's recompute state outlives it; bad input refused; a
fault and a cancellation at a RECOMPUTE step, and the next run on the same stages
identical; the wrapper is transparent outside a run.

torch's stages are an attention block (saves strided views) then an MLP with dropout:
the forward's generator states are restored for the re-run, and the same stages in eval
mode give other losses (dropout is active). MindSpore's are the demo's deterministic MLP
blocks: its ``nn.Dropout`` keeps per-operator states no generator state restores, so
wrapping one is refused.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from ppswap import (
    PipelineError,
    PipelineStage,
    RunResult,
    StepKind,
    recompute_wrapper,
    run_schedule,
)
from ppswap.core.faults import FaultPlan, call_at, fail_compute
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.swap import swap_wrapper
from ppswap.swap.recompute import ChunkRecompute, RecomputedTensor

Wrap = Callable[[Any], Any]


@dataclass(frozen=True)
class Case:
    schedule: str = "gpipe"
    stage_num: int = 2
    pp: int = 2
    micro: int = 4
    overlap_b_f: bool = False
    split_dw: bool = False
    p2p: str = "plain"


def plain(block: Any) -> Any:
    return block


def recompute_swap(block: Any) -> Any:
    return recompute_wrapper(swap_wrapper(block))


def swap_recompute(block: Any) -> Any:
    return swap_wrapper(recompute_wrapper(block))


@dataclass(frozen=True)
class Kit:
    """A backend's stages (two blocks a stage, each wrapped by its own ``Wrap``, the same
    weights whatever the wraps), batch, loss, gradients as host arrays, and whether its
    recomputed blocks draw dropout masks. ``block`` is one block and ``sample`` an input
    for it (the wrapper outside a run); ``seed`` sets the generators before a run."""

    stages: Callable[[int, Wrap, Wrap, DeviceMesh | None], list[PipelineStage]]
    inputs: Any
    targets: Any
    loss_fn: Any
    grads: Callable[[list[PipelineStage]], list[np.ndarray]]
    seed: Callable[[], None]
    dropout: bool
    block: Callable[[], Any]
    sample: Any
    to_host: Callable[[Any], np.ndarray]


def mindspore_kit() -> Kit:
    pytest.importorskip("mindspore")
    from mindspore import Tensor, nn

    from ppswap.demo.model import MLPBlock, build_mlp_stages, mse_loss

    def stages(stage_num: int, first: Wrap, second: Wrap, mesh: DeviceMesh | None) -> list[Any]:
        out: list[PipelineStage] = []
        for dp_rank in range(1 if mesh is None else mesh.dp):
            for index, module in enumerate(build_mlp_stages(stage_num)):
                blocks = list(module.cell_list)
                wrapped = nn.SequentialCell([first(blocks[0]), second(blocks[1])])
                if mesh is not None:
                    fully_shard(wrapped, mesh=mesh, dp_rank=dp_rank)
                out.append(PipelineStage(wrapped, index, stage_num))
        return out

    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 16)).astype(np.float32)
    y = rng.standard_normal((8, 16)).astype(np.float32)
    return Kit(
        stages=stages,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        grads=lambda stages: [g.asnumpy().copy() for s in stages for g in s.grads],
        seed=lambda: None,
        dropout=False,
        block=lambda: MLPBlock(16),
        sample=Tensor(x),
        to_host=lambda t: t.asnumpy(),
    )


def torch_kit() -> Kit:
    torch = pytest.importorskip("torch")
    from torch import nn

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_backend"))
    from torch_support import AttentionBlock, make_data, mse_loss

    class DropMLP(nn.Module):
        """``x + fc2(dropout(tanh(fc1(x))))``: random numbers in the recomputed block."""

        def __init__(self, dim: int = 8, hidden: int = 15) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
            self.drop = nn.Dropout(0.3)

        def forward(self, x: Any) -> Any:
            return x + self.fc2(self.drop(torch.tanh(self.fc1(x))))

    def stages(stage_num: int, first: Wrap, second: Wrap, mesh: DeviceMesh | None) -> list[Any]:
        out: list[PipelineStage] = []
        for dp_rank in range(1 if mesh is None else mesh.dp):
            with torch.random.fork_rng():
                torch.manual_seed(0)
                built = [(AttentionBlock(), DropMLP()) for _ in range(stage_num)]
            for index, (attention, mlp) in enumerate(built):
                module = nn.Sequential(first(attention), second(mlp))
                if mesh is not None:
                    fully_shard(module, mesh=mesh, dp_rank=dp_rank)
                out.append(PipelineStage(module, index, stage_num))
        return out

    def block() -> Any:
        torch.manual_seed(0)
        return DropMLP().eval()

    x, y = make_data()
    return Kit(
        stages=stages,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        grads=lambda stages: [g.detach().numpy().copy() for s in stages for g in s.grads],
        seed=lambda: torch.manual_seed(5),
        dropout=True,
        block=block,
        sample=torch.from_numpy(x),
        to_host=lambda t: t.detach().numpy(),
    )


KITS = {"mindspore": mindspore_kit, "torch": torch_kit}


@pytest.fixture
def kit(backend: str) -> Kit:
    return KITS[backend]()


async def run(kit: Kit, stages: list[PipelineStage], case: Case, **options: Any) -> RunResult:
    kit.seed()
    return await run_schedule(
        list(stages),
        case.schedule,
        micro_batch_num=case.micro,
        inputs=kit.inputs,
        targets=kit.targets,
        loss_fn=kit.loss_fn,
        pp=case.pp,
        overlap_b_f=case.overlap_b_f,
        split_dw=case.split_dw,
        p2p=case.p2p,
        step_timeout=60.0,
        **options,
    )


def assert_same(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    assert len(a) == len(b) > 0
    assert all(np.array_equal(g, h) for g, h in zip(a, b, strict=True))


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
async def test_recompute_is_bit_identical_and_lowers_the_peak(kit: Kit, case: Case) -> None:
    base_stages = kit.stages(case.stage_num, plain, plain, None)
    base = await run(kit, base_stages, case)
    stages = kit.stages(case.stage_num, recompute_wrapper, recompute_wrapper, None)
    result = await run(kit, stages, case, recompute=True)
    assert result.losses == base.losses
    assert_same(kit.grads(stages), kit.grads(base_stages))
    # every chunk recomputed, its RECOMPUTE run once
    for rank in result.ranks:
        assert set(rank.chunk_policy.values()) == {"recompute"}
        assert rank.compute_jobs["recompute"] == len(rank.chunk_policy)
        assert rank.saved_bytes_left == 0
    # the first rank's chunks wait longest for their backward: its peak goes down
    assert result.ranks[0].peak_saved_bytes < base.ranks[0].peak_saved_bytes
    if kit.dropout:  # dropout is active: the same stages in eval mode give other losses
        for stage in stages:
            stage.module.eval()
        assert (await run(kit, stages, case, recompute=True)).losses != base.losses


@pytest.mark.asyncio
async def test_recompute_under_fsdp_is_bit_identical(kit: Kit) -> None:
    case, mesh = Case("1f1b", overlap_b_f=True), DeviceMesh(pp=2, dp=2)
    base_stages = kit.stages(case.stage_num, plain, plain, mesh)
    base = await run(kit, base_stages, case, mesh=mesh)
    stages = kit.stages(case.stage_num, recompute_wrapper, recompute_wrapper, mesh)
    result = await run(kit, stages, case, mesh=mesh, recompute=True)
    assert result.losses == base.losses
    assert_same(kit.grads(stages), kit.grads(base_stages))
    assert result.ranks[0].peak_saved_bytes < base.ranks[0].peak_saved_bytes


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:swap=True moved nothing")  # recompute won for every block
@pytest.mark.parametrize(
    ("first", "second"),
    [
        (swap_wrapper, recompute_wrapper),  # different blocks
        (recompute_swap, recompute_swap),  # one block wrapped by both
        (swap_recompute, swap_recompute),  # ... in the other order
    ],
    ids=["different-blocks", "recompute(swap)", "swap(recompute)"],
)
async def test_swap_and_recompute_in_one_run(kit: Kit, first: Wrap, second: Wrap) -> None:
    case = Case("gpipe")
    base_stages = kit.stages(case.stage_num, plain, plain, None)
    base = await run(kit, base_stages, case)
    stages = kit.stages(case.stage_num, first, second, None)
    result = await run(kit, stages, case, swap=True, recompute=True)
    assert result.losses == base.losses
    assert_same(kit.grads(stages), kit.grads(base_stages))
    head = result.ranks[0]
    assert set(head.chunk_policy.values()) == {"recompute+swap"}
    both_wrapped = first is second
    # recompute wins for a block wrapped by both: nothing of it moves
    assert (head.offloaded_bytes == 0) == both_wrapped
    assert head.peak_saved_bytes < base.ranks[0].peak_saved_bytes
    # swap alone on the same stages moves the recompute-wrapped blocks too
    alone = await run(kit, stages, case, swap=True)
    assert alone.losses == base.losses
    assert_same(kit.grads(stages), kit.grads(base_stages))
    assert alone.ranks[0].offloaded_bytes > 0


def _live(kind: type) -> int:
    gc.collect()
    return sum(type(o) is kind for o in gc.get_objects())


@pytest.mark.asyncio
async def test_nothing_of_a_recompute_run_outlives_it(kit: Kit) -> None:
    """The re-run forward's graph is dropped with the step: no chunk's recompute state and
    no regenerated tensor stays alive (a saved output returned as is by the re-run's pack
    hook held its own graph in a cycle the garbage collector cannot see)."""
    case = Case("1f1b", overlap_b_f=True, split_dw=True)
    stages = kit.stages(case.stage_num, recompute_wrapper, recompute_wrapper, None)
    for _ in range(2):
        result = await run(kit, stages, case, recompute=True)
        assert result.ranks[0].compute_jobs["recompute"] == case.micro
        del result
        assert _live(ChunkRecompute) == 0
        assert _live(RecomputedTensor) == 0


@pytest.mark.asyncio
async def test_bad_recompute_input_is_refused_before_anything_runs(kit: Kit) -> None:
    case = Case("gpipe")
    with pytest.raises(ValueError, match="recompute=True needs a stage with a recompute_wrapper"):
        await run(kit, kit.stages(2, plain, plain, None), case, recompute=True)
    wrapped = kit.stages(2, recompute_wrapper, plain, None)
    with pytest.raises(ValueError, match="recompute must be False for a forward-only run"):
        await run(kit, wrapped, case, recompute=True, forward_only=True)
    with pytest.raises(TypeError, match="recompute must be a bool"):
        await run(kit, wrapped, case, recompute=1)
    with pytest.raises(TypeError, match=r"recompute_wrapper\(module=...\)"):
        recompute_wrapper(lambda x: x)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "case",
    [Case("1f1b", overlap_b_f=True), Case("1f1b", overlap_b_f=True, split_dw=True)],
    ids=["overlap", "overlap-split-dw"],
)
async def test_a_fault_at_a_recompute_step_then_the_same_stages_run_again(
    kit: Kit, case: Case
) -> None:
    base_stages = kit.stages(case.stage_num, plain, plain, None)
    base = await run(kit, base_stages, case)
    stages = kit.stages(case.stage_num, recompute_wrapper, recompute_wrapper, None)
    plan = FaultPlan((fail_compute(StepKind.RECOMPUTE, rank=0, stage=0, micro=1),))
    with pytest.raises(PipelineError, match=r"step R1\.0"):
        await run(kit, stages, case, recompute=True, faults=plan)
    again = await run(kit, stages, case, recompute=True)
    assert again.losses == base.losses
    assert_same(kit.grads(stages), kit.grads(base_stages))
    assert all(r.saved_bytes_left == 0 and r.groups_left == 0 for r in again.ranks)


@pytest.mark.asyncio
@pytest.mark.parametrize("micro", [0, 2])
async def test_a_cancellation_at_a_recompute_step_then_the_same_stages_run_again(
    kit: Kit, micro: int
) -> None:
    case = Case("1f1b", overlap_b_f=True, split_dw=True)
    base_stages = kit.stages(case.stage_num, plain, plain, None)
    base = await run(kit, base_stages, case)
    stages = kit.stages(case.stage_num, recompute_wrapper, recompute_wrapper, None)
    with anyio.CancelScope() as scope:
        plan = FaultPlan((call_at(scope.cancel, StepKind.RECOMPUTE, rank=1, stage=1, micro=micro),))
        await run(kit, stages, case, recompute=True, faults=plan)
    assert scope.cancelled_caught
    again = await run(kit, stages, case, recompute=True)
    assert again.losses == base.losses
    assert_same(kit.grads(stages), kit.grads(base_stages))
    assert all(r.saved_bytes_left == 0 and r.groups_left == 0 for r in again.ranks)


def test_recompute_wrapper_is_transparent_outside_a_run(kit: Kit) -> None:
    block = kit.block()
    wrapped = recompute_wrapper(block)
    assert np.array_equal(kit.to_host(wrapped(kit.sample)), kit.to_host(block(kit.sample)))
    inner = list(block.parameters() if hasattr(block, "parameters") else block.get_parameters())
    outer = list(
        wrapped.parameters() if hasattr(wrapped, "parameters") else wrapped.get_parameters()
    )
    assert len(inner) == len(outer) > 0
    assert all(p is q for p, q in zip(outer, inner, strict=True))


@pytest.mark.mindspore
def test_a_mindspore_block_whose_dropout_masks_cannot_be_replayed_is_refused() -> None:
    """MindSpore's nn.Dropout keeps per-operator states no generator state restores: a
    recomputed block would train on other masks than its forward's, so wrapping one is
    refused in one line naming it; a dropout that drops nothing is fine."""
    pytest.importorskip("mindspore")
    from mindspore import nn

    class DropoutBlock(nn.Cell):  # type: ignore[misc]
        def __init__(self, p: float) -> None:
            super().__init__()
            self.fc, self.drop = nn.Dense(4, 4), nn.Dropout(p=p)

        def construct(self, x: Any) -> Any:
            return self.drop(self.fc(x))

    with pytest.raises(ValueError, match=r"nn\.Dropout 'drop' with p=0\.1.*cannot replay"):
        recompute_wrapper(DropoutBlock(0.1))
    recompute_wrapper(DropoutBlock(0.0))
