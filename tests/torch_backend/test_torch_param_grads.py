"""On torch, a training run leaves its gradients in each parameter's ``.grad``, as
``loss.backward()`` would, so a ``torch.optim`` optimizer steps on them as it does after
torch.distributed.pipelining's ``step``.

Checked: after a run ``.grad`` is ``stage.grads`` (set where it was None, the same tensor);
equal to the unsplit model's gradients; a second run without ``zero_grad`` adds into it;
an optimizer step on the stages equals the same step on the unsplit model; forward-only
runs and failed runs leave ``.grad`` as it was; FSDP leaves the shard gradients on the
shard parameters; a parameter two stages share (tied weights) gets the sum in ``.grad``,
once, and each stage's ``stage.grads`` holds that sum too.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch_support import (
    DIM,
    GPIPE_CASE,
    Case,
    build_modules,
    build_stages,
    make_data,
    run_case,
    sharded_stages,
    unsplit_loss_and_grads,
)

from ppswap import PipelineError, PipelineStage
from ppswap.fsdp import DeviceMesh

INTERLEAVED = Case("interleaved_1f1b", pp=2, stage_num=4, micro=4)


def param_grads(stages: list[PipelineStage]) -> list[list[torch.Tensor | None]]:
    return [[p.grad for p in stage.parameters] for stage in stages]


@pytest.mark.asyncio
@pytest.mark.parametrize("swap", [False, True], ids=["swap-off", "swap-on"])
async def test_a_run_leaves_its_gradients_in_grad(swap: bool) -> None:
    stages = build_stages(INTERLEAVED.stage_num)
    await run_case(stages, INTERLEAVED, swap=swap)
    _, expected = unsplit_loss_and_grads(build_modules(INTERLEAVED.stage_num), *make_data())
    for stage, reference in zip(stages, expected, strict=True):
        for param, grad, want in zip(stage.parameters, stage.grads, reference, strict=True):
            assert param.grad is grad  # set where None: the run's own tensor, no copy
            torch.testing.assert_close(param.grad, want, rtol=1e-5, atol=1e-7)


@pytest.mark.asyncio
async def test_a_second_run_without_zero_grad_adds_into_grad() -> None:
    stages = build_stages(GPIPE_CASE.stage_num)
    await run_case(stages, GPIPE_CASE, swap=True)
    first = [[g.clone() for g in stage.grads] for stage in stages]
    await run_case(stages, GPIPE_CASE, swap=True)
    for stage, grads in zip(stages, first, strict=True):
        for param, grad in zip(stage.parameters, grads, strict=True):
            assert param.grad is not None
            assert torch.equal(param.grad, grad + grad)  # the same batch twice


@pytest.mark.asyncio
async def test_an_optimizer_steps_the_stages_as_it_steps_the_unsplit_model() -> None:
    """Three SGD steps with momentum and ``zero_grad`` between them, on the pipeline and on
    the unsplit model (``loss.backward()``): the same weights (rtol 1e-5). (SGD: an update
    linear in the gradient; Adam's first steps are about the gradient's sign, which
    rounding flips on elements near zero.)"""
    stages = build_stages(GPIPE_CASE.stage_num)
    reference = nn.Sequential(*build_modules(GPIPE_CASE.stage_num))
    optimizer = torch.optim.SGD([p for s in stages for p in s.parameters], lr=0.1, momentum=0.9)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    x, y = make_data()
    for _ in range(3):
        optimizer.zero_grad()
        await run_case(stages, GPIPE_CASE, swap=True)
        optimizer.step()
        reference_optimizer.zero_grad()
        loss = ((reference(torch.from_numpy(x)) - torch.from_numpy(y)) ** 2).mean()
        loss.backward()
        reference_optimizer.step()
    ours = [p for s in stages for p in s.parameters]
    for param, want in zip(ours, reference.parameters(), strict=True):
        torch.testing.assert_close(param, want, rtol=1e-5, atol=1e-6)


class Tied(nn.Module):
    """A stage with a projection shared with another stage: applied before the stage's
    own blocks on the first stage, after them on the last."""

    def __init__(self, inner: nn.Module, shared: nn.Linear, *, before: bool) -> None:
        super().__init__()
        self.inner, self.shared, self.before = inner, shared, before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = (
            self.inner(self.shared(x)) if self.before else self.shared(self.inner(x))
        )
        return out


def tied_modules(stage_num: int) -> list[nn.Module]:
    """``stage_num`` stage models; the first and the last share one ``nn.Linear``."""
    modules: list[nn.Module] = list(build_modules(stage_num))
    with torch.random.fork_rng():
        torch.manual_seed(5)
        shared = nn.Linear(DIM, DIM)
    modules[0] = Tied(modules[0], shared, before=True)
    modules[-1] = Tied(modules[-1], shared, before=False)
    return modules


@pytest.mark.asyncio
@pytest.mark.parametrize("swap", [False, True], ids=["swap-off", "swap-on"])
async def test_tied_weights_get_the_sum_once_and_each_stage_holds_it(swap: bool) -> None:
    """Interleaved pp2: stages 0 and 3 (both on rank 0) share a projection. Its ``.grad``
    is the unsplit model's (both uses summed, not twice), and stage 0's and stage 3's
    gradients of it are that same tensor."""
    modules = tied_modules(INTERLEAVED.stage_num)
    stages = [PipelineStage(m, i, len(modules)) for i, m in enumerate(modules)]
    await run_case(stages, INTERLEAVED, swap=swap)
    _, expected = unsplit_loss_and_grads(tied_modules(INTERLEAVED.stage_num), *make_data())
    first, last = stages[0], stages[-1]
    shared = first.module.shared.weight
    k_first = next(i for i, p in enumerate(first.parameters) if p is shared)
    k_last = next(i for i, p in enumerate(last.parameters) if p is shared)
    assert shared.grad is not None
    torch.testing.assert_close(shared.grad, expected[0][k_first], rtol=1e-5, atol=1e-7)
    assert first.grads[k_first] is shared.grad and last.grads[k_last] is shared.grad
    for stage, reference in zip(stages[1:-1], expected[1:-1], strict=True):
        for param, want in zip(stage.parameters, reference, strict=True):
            torch.testing.assert_close(param.grad, want, rtol=1e-5, atol=1e-7)


@pytest.mark.asyncio
async def test_forward_only_leaves_grad_alone() -> None:
    """A training run, ``zero_grad``, then an evaluation run: ``.grad`` stays None (the
    stages still hold the training run's gradients)."""
    stages = build_stages(GPIPE_CASE.stage_num)
    await run_case(stages, GPIPE_CASE, swap=False)
    for stage in stages:
        for param in stage.parameters:
            param.grad = None
    await run_case(stages, GPIPE_CASE, swap=False, forward_only=True)
    assert all(g is None for grads in param_grads(stages) for g in grads)


class FailingStage(nn.Module):
    """The stage's module, raising in the forward of the last micro-batch."""

    def __init__(self, inner: nn.Module, fail_after: int) -> None:
        super().__init__()
        self.inner, self.fail_after, self.calls = inner, fail_after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > self.fail_after:
            raise RuntimeError("injected failure")
        out: torch.Tensor = self.inner(x)
        return out


@pytest.mark.asyncio
async def test_a_failed_run_leaves_grad_alone() -> None:
    """A run that fails after some backwards ran: ``.grad`` is what it was before it."""
    modules = build_modules(GPIPE_CASE.stage_num)
    stages = [
        PipelineStage(FailingStage(m, fail_after=GPIPE_CASE.micro + 1), i, GPIPE_CASE.stage_num)
        for i, m in enumerate(modules)
    ]
    await run_case(stages, GPIPE_CASE, swap=True)  # one good run: .grad set
    before = [[g.clone() for g in grads if g is not None] for grads in param_grads(stages)]
    with pytest.raises(PipelineError):
        await run_case(stages, Case("1f1b", pp=2, stage_num=2, micro=4), swap=True)
    after = [[g for g in grads if g is not None] for grads in param_grads(stages)]
    assert [len(g) for g in after] == [len(g) for g in before]
    for grads, kept in zip(after, before, strict=True):
        assert all(torch.equal(g, k) for g, k in zip(grads, kept, strict=True))


@pytest.mark.asyncio
async def test_fsdp_leaves_the_shard_gradients_on_the_shards() -> None:
    mesh = DeviceMesh(pp=2, dp=2)
    stages = sharded_stages(GPIPE_CASE.stage_num, mesh)
    await run_case(stages, GPIPE_CASE, swap=True, pp=2)
    for stage in stages:
        for param, grad in zip(stage.parameters, stage.grads, strict=True):
            assert param.grad is grad
            assert param.grad.shape == param.shape
