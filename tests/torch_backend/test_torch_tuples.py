"""Several tensors between stages on torch: a stage returns a tuple, the next is called with
its elements.

The model passes ``(hidden, mask, scale)`` along: ``mask`` an int64 tensor (no gradient
travels back for it; the middle stages return the one they received, unchanged), ``scale``
a float tensor every stage uses and changes (its gradient travels back beside the hidden
state's). Checked for each schedule (GPipe, 1F1B with the boundary P2P mode, Interleaved
with split_dw and overlap_b_f): swap on bit-identical to swap off, both equal to the
unsplit model (rtol 1e-5), bytes moved. A batch given as a tuple (``inputs=(x, mask)``)
reaches the first stage split alike (a dict: as keyword arguments), and so do targets
given as a tuple (``targets=(y, loss_mask)``, ``loss_fn`` called with a tuple); a bad one
of either is refused before any work. FSDP dp2 with tuples: swap on equal to off, full
gradients equal to the unsplit model's. A forward-only run gives the training run's
losses. What a stage may return: a list works as a tuple, a tuple holding a non-tensor or
a dict is a PipelineInputError naming the stage and the element.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch_support import BATCH, DIM, SEQ, Case, MLPBlock, mse_loss

from ppswap import PipelineError, PipelineInputError, PipelineStage, RunResult, run_schedule
from ppswap.fsdp import DeviceMesh, full_gradients, fully_shard
from ppswap.swap import swap_wrapper

CASES = [
    Case("gpipe", pp=2, stage_num=2, micro=4),
    Case("1f1b", pp=3, stage_num=3, micro=8, p2p="boundary"),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4, split_dw=True, overlap_b_f=True),
]


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = swap_wrapper(MLPBlock())

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.block(x)
        if mask is None:  # not in the batch: made here
            mask = (x[..., :1] > -0.5).long()  # (batch, seq, 1) int64
        return hidden, mask, torch.sigmoid(hidden.mean(-1, keepdim=True))


class Middle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = swap_wrapper(MLPBlock())

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        hidden = self.block(hidden) * scale * mask
        return hidden, mask, scale * torch.tanh(hidden.mean(-1, keepdim=True))


class Last(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = swap_wrapper(MLPBlock())

    def forward(
        self, hidden: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        out: torch.Tensor = self.block(hidden) * mask + scale
        return out


def modules(stage_num: int) -> list[nn.Module]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return [First(), *(Middle() for _ in range(stage_num - 2)), Last()]


def data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn((BATCH, SEQ, DIM), generator=generator)
    return x, torch.randn((BATCH, SEQ, DIM), generator=generator)


def batch_mask() -> torch.Tensor:
    """A mask that comes with the batch (``inputs=(x, mask)``), one sample in two kept."""
    return (torch.arange(BATCH * SEQ).reshape(BATCH, SEQ, 1) % 2).long()


def unsplit(
    stage_num: int, *, with_mask: bool = False, targets: Any = None, loss_fn: Any = mse_loss
) -> tuple[float, list[list[torch.Tensor]]]:
    """The unsplit model on the whole batch (``with_mask``: ``inputs=(x, mask)``;
    ``targets``: instead of ``y``, for ``loss_fn``): its loss and gradients by stage."""
    chain = modules(stage_num)
    x, y = data()
    out: torch.Tensor | tuple[torch.Tensor, ...] = (x, batch_mask()) if with_mask else x
    for module in chain:
        out = module(*out) if isinstance(out, tuple) else module(out)
    assert isinstance(out, torch.Tensor)
    loss = loss_fn(out, y if targets is None else targets)
    params = [list(m.parameters()) for m in chain]
    flat = torch.autograd.grad(loss, [p for group in params for p in group])
    grads, start = [], 0
    for group in params:
        grads.append(list(flat[start : start + len(group)]))
        start += len(group)
    return float(loss.detach()), grads


async def run(
    case: Case, *, swap: bool, with_mask: bool = False, **overrides: Any
) -> tuple[RunResult, list[list[torch.Tensor]]]:
    """``case`` on fresh stages (``overrides``: run_schedule's keywords)."""
    stages = [PipelineStage(m, i, case.stage_num) for i, m in enumerate(modules(case.stage_num))]
    x, y = data()
    options: dict[str, Any] = {
        "pp": case.pp,
        "micro_batch_num": case.micro,
        "inputs": (x, batch_mask()) if with_mask else x,
        "targets": y,
        "loss_fn": mse_loss,
        "swap": swap,
        "split_dw": case.split_dw,
        "overlap_b_f": case.overlap_b_f,
        "p2p": case.p2p,
        "step_timeout": 60,
    }
    result = await run_schedule(stages, case.schedule, **(options | overrides))
    return result, [[g.clone() for g in s.grads] for s in stages]


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=[c.label() for c in CASES])
async def test_tuples_between_stages_swap_bit_identically_and_match_the_unsplit_model(
    case: Case,
) -> None:
    off, grads_off = await run(case, swap=False)
    on, grads_on = await run(case, swap=True)
    assert on.losses == off.losses
    for stage_off, stage_on in zip(grads_off, grads_on, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(stage_off, stage_on, strict=True))
    assert sum(rank.offloaded_bytes for rank in on.ranks) > 0
    loss, expected = unsplit(case.stage_num)
    assert on.loss == pytest.approx(loss, rel=1e-5)
    for got_stage, want_stage in zip(grads_on, expected, strict=True):
        for got, want in zip(got_stage, want_stage, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    # the scale's gradient travelled back: without it the first stage's would differ
    assert any(float(g.abs().max()) > 0 for g in grads_on[0])


@pytest.mark.asyncio
async def test_a_batch_given_as_a_tuple_reaches_the_first_stage_split_alike() -> None:
    """``inputs=(x, mask)``: each split into the same micro-batches, the first stage's
    module called with one of each (here the mask zeroes every other sample's output)."""
    case = CASES[1]
    off, grads_off = await run(case, swap=False, with_mask=True)
    on, grads_on = await run(case, swap=True, with_mask=True)
    assert on.losses == off.losses
    for stage_off, stage_on in zip(grads_off, grads_on, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(stage_off, stage_on, strict=True))
    loss, expected = unsplit(case.stage_num, with_mask=True)
    assert on.loss == pytest.approx(loss, rel=1e-5)
    assert on.loss != pytest.approx(unsplit(case.stage_num)[0], rel=1e-3)  # the mask was used
    for got_stage, want_stage in zip(grads_on, expected, strict=True):
        for got, want in zip(got_stage, want_stage, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def masked_mse(output: torch.Tensor, target: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The loss of ``targets=(y, weights)``: squared errors, weighted (a loss mask)."""
    y, weights = target
    return ((output - y) ** 2 * weights).mean()


def sample_weights() -> torch.Tensor:
    """A weight per sample, (BATCH, 1, 1): a micro-batch paired with another's shows."""
    return torch.arange(BATCH, dtype=torch.float32).reshape(BATCH, 1, 1) % 3


@pytest.mark.asyncio
async def test_targets_given_as_a_tuple_reach_loss_fn_split_alike() -> None:
    """``targets=(y, loss_mask)``: each split into the same micro-batches, ``loss_fn``
    called with a tuple of one of each; swap on equal to off, both the unsplit model's."""
    case = CASES[1]
    targets = (data()[1], sample_weights())
    off, grads_off = await run(case, swap=False, targets=targets, loss_fn=masked_mse)
    on, grads_on = await run(case, swap=True, targets=targets, loss_fn=masked_mse)
    assert on.losses == off.losses
    for stage_off, stage_on in zip(grads_off, grads_on, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(stage_off, stage_on, strict=True))
    loss, expected = unsplit(case.stage_num, targets=targets, loss_fn=masked_mse)
    assert on.loss == pytest.approx(loss, rel=1e-5)
    assert on.loss != pytest.approx(unsplit(case.stage_num)[0], rel=1e-3)  # the weights count
    for got_stage, want_stage in zip(grads_on, expected, strict=True):
        for got, want in zip(got_stage, want_stage, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("targets", "words"),
    [
        ((), "targets as a tuple must hold 1 to 64 parts, got 0"),
        ((data()[1], batch_mask()[:4]), "every part of targets must have one batch size"),
        ((data()[1], None), "targets[1] must be a torch.Tensor or numpy.ndarray, got NoneType"),
        ((data()[1][:4], batch_mask()[:4]), "inputs and targets must have the same batch size"),
        ((data()[1].double(), batch_mask()), "targets[0] must have dtype float32"),
    ],
    ids=["empty", "batch-sizes", "not-a-tensor", "against-inputs", "dtype"],
)
async def test_bad_tuple_targets_are_named_before_any_work(targets: object, words: str) -> None:
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(modules(2))]
    with pytest.raises(PipelineInputError, match=re.escape(words)):
        await run_schedule(
            stages, "gpipe", micro_batch_num=2, inputs=data()[0], targets=targets, loss_fn=mse_loss
        )


@pytest.mark.asyncio
async def test_a_loss_fn_failing_on_tuple_targets_names_their_shapes() -> None:
    with pytest.raises(PipelineError) as caught:
        await run(CASES[0], swap=False, targets=(data()[1], batch_mask()), loss_fn=mse_loss)
    assert isinstance(caught.value.__cause__, PipelineInputError)
    assert "targets of shapes (2, 4, 8), (2, 4, 1)" in str(caught.value.__cause__)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("inputs", "words"),
    [
        ((), "inputs as a tuple must hold 1 to 64 parts, got 0"),
        ((data()[0], batch_mask()[:4]), "every part of inputs must have one batch size"),
        ((data()[0], "mask"), "inputs[1] must be a torch.Tensor or numpy.ndarray, got str"),
        ({}, "inputs as a dict must hold 1 to 64 parts, got 0"),
        ({"x": data()[0], 3: batch_mask()}, "inputs as a dict must have keyword names as keys"),
        ({"x": data()[0], "mask": batch_mask()[:4]}, "inputs['mask'] 4"),
    ],
    ids=["empty", "batch-sizes", "not-a-tensor", "dict-empty", "dict-not-a-name", "dict-sizes"],
)
async def test_a_bad_tuple_or_dict_batch_is_named_before_any_work(
    inputs: object, words: str
) -> None:
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(modules(2))]
    with pytest.raises(PipelineInputError, match=re.escape(words)):
        await run_schedule(
            stages, "gpipe", micro_batch_num=2, inputs=inputs, targets=data()[1], loss_fn=mse_loss
        )


class Returns(nn.Module):
    """Returns what ``make`` builds from the block's output."""

    def __init__(self, make: object) -> None:
        super().__init__()
        self.block, self.make = MLPBlock(), make

    def forward(self, x: torch.Tensor) -> object:
        return self.make(self.block(x))  # type: ignore[operator]


async def run_two(first: nn.Module, last: nn.Module) -> RunResult:
    stages = [PipelineStage(first, 0, 2), PipelineStage(last, 1, 2)]
    x, y = data()
    return await run_schedule(
        stages, "gpipe", micro_batch_num=2, inputs=x, targets=y, loss_fn=mse_loss, step_timeout=60
    )


class TakesTwo(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = MLPBlock()

    def forward(self, hidden: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(hidden + other)
        return out


@pytest.mark.asyncio
async def test_a_list_travels_as_a_tuple() -> None:
    result = await run_two(Returns(lambda h: [h, 2 * h]), TakesTwo())
    assert len(result.losses) == 2


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda h: (h, 3), "element 1 is int"),
        (lambda h: {"hidden": h}, "got dict"),
        (lambda h: (), "got tuple"),
    ],
    ids=["non-tensor-element", "dict", "empty"],
)
async def test_what_cannot_travel_is_named(make: object, words: str) -> None:
    with pytest.raises(PipelineError) as caught:
        await run_two(Returns(make), TakesTwo())
    assert (caught.value.rank, caught.value.step) == (0, "F0.0")
    assert isinstance(caught.value.__cause__, PipelineInputError)
    assert "stage 0's module" in str(caught.value.__cause__)
    assert words in str(caught.value.__cause__)


@pytest.mark.asyncio
@pytest.mark.parametrize("tuple_targets", [False, True], ids=["targets", "tuple-targets"])
async def test_fsdp_dp2_with_tuples_between_stages(tuple_targets: bool) -> None:
    """GPipe pp2 x dp2, every replica's stage fully_shard()-ed: swap on bit-identical to
    off, the full gradients equal to the unsplit model's; with targets given as a tuple
    too (each replica's block of them split alike)."""
    mesh = DeviceMesh(pp=2, dp=2)
    x, y = data()
    targets, loss_fn = ((y, sample_weights()), masked_mse) if tuple_targets else (y, mse_loss)
    full: list[list[list[np.ndarray]]] = []
    losses = []
    for swap in (False, True):
        stages = []
        for dp_rank in range(mesh.dp):
            for index, module in enumerate(modules(2)):
                fully_shard(module, mesh=mesh, dp_rank=dp_rank)
                stages.append(PipelineStage(module, index, 2))
        result = await run_schedule(
            stages,
            "gpipe",
            micro_batch_num=2,
            inputs=x,
            targets=targets,
            loss_fn=loss_fn,
            swap=swap,
            step_timeout=60,
        )
        losses.append(result.losses)
        full.append([full_gradients([s for s in stages if s.stage_index == i]) for i in range(2)])
    assert losses[0] == losses[1]
    for stage_off, stage_on in zip(*full, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(stage_off, stage_on, strict=True))
    _, expected = unsplit(2, targets=targets, loss_fn=loss_fn)
    for got_stage, want_stage in zip(full[1], expected, strict=True):
        for got, want in zip(got_stage, want_stage, strict=True):
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.asyncio
async def test_a_tuple_batch_the_first_module_cannot_take_is_named() -> None:
    stages = [PipelineStage(Returns(lambda h: h), 0, 2), PipelineStage(Returns(lambda h: h), 1, 2)]
    x, y = data()
    with pytest.raises(PipelineError) as caught:
        await run_schedule(
            stages, "gpipe", micro_batch_num=2, inputs=(x, x), targets=y, loss_fn=mse_loss
        )
    assert (caught.value.rank, caught.value.step) == (0, "F0.0")
    assert "stage 0's module raised TypeError when called with the 2 parts of the batch" in str(
        caught.value.__cause__
    )


@pytest.mark.asyncio
async def test_a_batch_given_as_a_dict_calls_the_first_module_with_keywords() -> None:
    """``inputs={"mask": ..., "x": ...}`` (not the signature's order): the first stage's
    module gets ``x=``, ``mask=`` per micro-batch, bit for bit the run with
    ``inputs=(x, mask)``, swap on."""
    case = CASES[1]
    x = data()[0]
    positional, grads_positional = await run(case, swap=True, with_mask=True)
    keywords, grads_keywords = await run(case, swap=True, inputs={"mask": batch_mask(), "x": x})
    assert keywords.losses == positional.losses
    for stage_a, stage_b in zip(grads_positional, grads_keywords, strict=True):
        assert all(torch.equal(a, b) for a, b in zip(stage_a, stage_b, strict=True))
    # the first stage made its own mask from x when none came: the keywords reached it
    assert keywords.losses != (await run(case, swap=True, inputs={"x": x}))[0].losses


@pytest.mark.asyncio
async def test_a_keyword_the_first_module_does_not_take_is_named() -> None:
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(modules(2))]
    x, y = data()
    with pytest.raises(PipelineError) as caught:
        await run_schedule(
            stages,
            "gpipe",
            micro_batch_num=2,
            inputs={"x": x, "attention_mask": batch_mask()},
            targets=y,
            loss_fn=mse_loss,
        )
    assert (caught.value.rank, caught.value.step) == (0, "F0.0")
    assert "keyword arguments x, attention_mask (the batch's parts)" in str(caught.value.__cause__)


@pytest.mark.asyncio
async def test_a_forward_only_run_passes_tuples_and_gives_the_training_runs_losses() -> None:
    case = CASES[2]
    trained, _ = await run(case, swap=False)
    evaluated, _ = await run(case, swap=False, forward_only=True, split_dw=False, overlap_b_f=False)
    assert evaluated.losses == trained.losses
