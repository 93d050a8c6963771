"""Random numbers (dropout) on torch: each stage draws from a stream of its own.

Ranks in one process share one compute thread, and the order in which their forwards
reach it depends on timing; drawn from the process's generator, a forward's dropout mask
would depend on what other stages drew before it (measured before the streams: 1F1B pp4
with dropout, swap on against off, different losses in 4 of 16 runs). Checked here,
without relying on timing: a stage's draws do not change when another stage draws more
numbers between its forwards; swap on equals swap off with dropout; a run moves the
process's generator by one draw; stages draw distinct numbers; consecutive runs draw new
numbers, and seeding again repeats them.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch_support import Case, build_modules, grads_of, run_case

from ppswap import PipelineStage, RunResult

CASE = Case("1f1b", pp=4, stage_num=4, micro=8)


class Draws(nn.Module):
    """``inner`` then dropout; records each forward's own draw (``drawn``), and with
    ``extra`` draws that many more numbers it throws away."""

    def __init__(self, inner: nn.Module, *, extra: int = 0) -> None:
        super().__init__()
        self.inner, self.extra = inner, extra
        self.dropout = nn.Dropout(0.3)
        self.drawn: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.drawn.append(torch.rand(4))
        if self.extra:
            torch.rand(self.extra)
        out: torch.Tensor = self.dropout(self.inner(x))
        return out


def stages_with_draws(*, extra_on_stage: int | None = None) -> list[PipelineStage]:
    modules = [
        Draws(module, extra=1000 if index == extra_on_stage else 0)
        for index, module in enumerate(build_modules(CASE.stage_num))
    ]
    return [PipelineStage(m, i, CASE.stage_num) for i, m in enumerate(modules)]


def drawn(stages: list[PipelineStage]) -> list[list[torch.Tensor]]:
    return [list(stage.module.drawn) for stage in stages]


async def run(stages: list[PipelineStage], *, swap: bool) -> RunResult:
    torch.manual_seed(11)
    return await run_case(stages, CASE, swap=swap)


def same(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> bool:
    return all(
        len(x) == len(y) and all(torch.equal(p, q) for p, q in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.asyncio
async def test_a_stages_draws_do_not_depend_on_other_stages_draws() -> None:
    """Stage 1 draws 1000 more numbers in each forward: its own stream moves, the other
    stages draw what they drew without it (from one generator they would not: in one
    process the stages' forwards interleave on the compute thread)."""
    plain, noisy = stages_with_draws(), stages_with_draws(extra_on_stage=1)
    await run(plain, swap=False)
    await run(noisy, swap=False)
    theirs, mine = drawn(plain), drawn(noisy)
    assert same([theirs[0], *theirs[2:]], [mine[0], *mine[2:]])
    assert not torch.equal(theirs[1][1], mine[1][1])  # stage 1's second draw moved


@pytest.mark.asyncio
async def test_dropout_is_bit_identical_with_swap_on_and_off() -> None:
    off_stages, on_stages = stages_with_draws(), stages_with_draws()
    off, on = await run(off_stages, swap=False), await run(on_stages, swap=True)
    assert sum(r.offloaded_bytes for r in on.ranks) > 0
    assert on.losses == off.losses
    assert same(grads_of(off_stages), grads_of(on_stages))
    assert same(drawn(off_stages), drawn(on_stages))


@pytest.mark.asyncio
async def test_streams_are_distinct_continue_across_runs_and_restart_when_seeded() -> None:
    stages = stages_with_draws()
    torch.manual_seed(11)
    first = await run_case(stages, CASE, swap=False)
    # the process's generator moved by the run's one draw, not by the forwards' draws
    assert torch.equal(torch.rand(3), torch.rand(3, generator=_after(first_seed=11)))
    per_stage = drawn(stages)
    assert not torch.equal(per_stage[0][0], per_stage[1][0])  # distinct streams
    second = await run_case(stages, CASE, swap=False)  # a new run, a new seed: new masks
    assert second.losses != first.losses
    again = await run(stages, swap=False)  # seeded again: the first run's masks
    assert again.losses == first.losses


def _after(first_seed: int) -> torch.Generator:
    """A generator seeded ``first_seed`` that made the one draw a run makes."""
    generator = torch.Generator().manual_seed(first_seed)
    torch.randint(0, 2**62, (1,), generator=generator)
    return generator
