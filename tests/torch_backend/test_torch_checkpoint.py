"""Swap beside activation checkpointing (``torch.utils.checkpoint``) and other hooks.

torch applies only the innermost saved-tensor hooks. A ``swap_wrapper`` region inside a
checkpointed one would take its saved tensors from the checkpoint, which keeps none of
them and recomputes them in the backward: swap would keep (and move) what checkpointing
drops, and the peak would rise with swap on. So a region yields to hooks that are not
ppswap's (``Backend.foreign_saved_tensors_hooks``). Checked here on Interleaved pp2 in
process: checkpointing around swap-wrapped blocks keeps swap off's peak with swap on and
moves nothing; swap-wrapped checkpointed blocks move what the checkpoint keeps; both are
bit-identical to swap off and to the same model without checkpointing. Reentrant
checkpointing cannot run under ``torch.autograd.grad`` (torch refuses it at the first
backward, naming the fix).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch_support import Case, build_modules, grads_of, make_data, run_case

from ppswap import PipelineStage, RunResult
from ppswap.backends.torch import BACKEND
from ppswap.errors import PipelineError
from ppswap.swap import swap_wrapper

CASE = Case("interleaved_1f1b", pp=2, stage_num=4, micro=4, p2p="batch")
Run = tuple[RunResult, list[list[torch.Tensor]]]


class Checkpointed(nn.Module):
    """``inner`` under ``torch.utils.checkpoint``."""

    def __init__(self, inner: nn.Module, *, reentrant: bool = False) -> None:
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        return out


def checkpointed_stages() -> list[nn.Module]:
    """Each stage under one checkpoint, its blocks swap-wrapped inside it."""
    return [Checkpointed(module) for module in build_modules(CASE.stage_num)]


def checkpointed_blocks() -> list[nn.Module]:
    """Each block checkpointed, then swap-wrapped."""
    modules = build_modules(CASE.stage_num, wrap=False)
    for module in modules:
        for index, block in enumerate(list(module.blocks)):
            module.blocks[index] = swap_wrapper(Checkpointed(block))
    return list(modules)


async def run(modules: list[nn.Module], swap: bool) -> Run:
    stages = [PipelineStage(m, i, CASE.stage_num) for i, m in enumerate(modules)]
    result = await run_case(stages, CASE, swap=swap)
    return result, grads_of(stages)


def assert_same(a: Run, b: Run) -> None:
    assert a[0].losses == b[0].losses
    for stage_a, stage_b in zip(a[1], b[1], strict=True):
        assert all(torch.equal(x, y) for x, y in zip(stage_a, stage_b, strict=True))


async def off_and_on(make: Callable[[], list[nn.Module]]) -> tuple[Run, Run]:
    """``make()``'s stages run swap off and on: each bit-identical to the other and to the
    same model without checkpointing."""
    off, on = await run(make(), swap=False), await run(make(), swap=True)
    assert_same(off, on)
    assert_same(off, await run(build_modules(CASE.stage_num), swap=False))
    return off, on


def test_hooks_other_than_ppswaps_are_told_apart() -> None:
    seen: list[bool] = []

    def note(x: torch.Tensor) -> torch.Tensor:
        seen.append(BACKEND.foreign_saved_tensors_hooks())
        return x.sin()

    assert not BACKEND.foreign_saved_tensors_hooks()
    with BACKEND.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert not BACKEND.foreign_saved_tensors_hooks()
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            assert BACKEND.foreign_saved_tensors_hooks()
            with BACKEND.saved_tensors_hooks(lambda t: t, lambda t: t):
                assert not BACKEND.foreign_saved_tensors_hooks()
    x = torch.randn(3, requires_grad=True)
    checkpoint(note, x, use_reentrant=False).sum().backward()
    assert seen == [True, True]  # the forward, and its recomputation in the backward


@pytest.mark.asyncio
async def test_checkpointing_around_swap_wrapped_blocks_keeps_its_memory() -> None:
    off, on = await off_and_on(checkpointed_stages)
    for rank_off, rank_on in zip(off[0].ranks, on[0].ranks, strict=True):
        assert rank_on.offloaded_bytes == 0  # the checkpoint keeps nothing to move
        assert rank_on.peak_saved_bytes == rank_off.peak_saved_bytes


@pytest.mark.asyncio
async def test_swap_wrapped_checkpointed_blocks_move_what_the_checkpoint_keeps() -> None:
    off, on = await off_and_on(checkpointed_blocks)
    assert sum(r.offloaded_bytes for r in on[0].ranks) > 0
    assert all(r.loaded_bytes == r.offloaded_bytes for r in on[0].ranks)
    assert on[0].ranks[0].peak_saved_bytes < off[0].ranks[0].peak_saved_bytes


@pytest.mark.asyncio
@pytest.mark.filterwarnings("ignore:None of the inputs have requires_grad=True")
async def test_reentrant_checkpointing_is_refused_by_torch_at_the_first_backward() -> None:
    modules = [Checkpointed(m, reentrant=True) for m in build_modules(CASE.stage_num)]
    x, y = make_data()
    stages = [PipelineStage(m, i, CASE.stage_num) for i, m in enumerate(modules)]
    with pytest.raises(PipelineError, match=r"step B0\.\d\].*use_reentrant=False"):
        await run_case(stages, CASE, swap=False, inputs=x, targets=y)
