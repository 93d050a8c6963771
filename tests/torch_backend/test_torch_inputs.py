"""Bad input to a torch run is refused with a message that names what is wrong."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import torch
from stage_runs import stage_runs_holding_chunks
from torch import nn
from torch_support import GPIPE_CASE, build_stages, make_data, mse_loss, run_case

from ppswap import PipelineError, PipelineInputError, PipelineStage, run_schedule

Array = npt.NDArray[np.float32]


@pytest.mark.mindspore
@pytest.mark.asyncio
async def test_a_torch_stage_mixed_with_a_mindspore_stage_is_refused() -> None:
    """One run, one framework: a torch stage next to a MindSpore stage is a TypeError that
    names each stage's framework, raised before anything runs."""
    ms = pytest.importorskip("mindspore")
    torch_stage = build_stages(2)[0]
    mindspore_stage = PipelineStage(ms.nn.Dense(8, 8), 1, 2)
    x, y = make_data()
    with pytest.raises(
        TypeError,
        match=r"stages must all be modules of one framework, got stage 0: torch, "
        r"stage 1: mindspore",
    ):
        await run_schedule(
            [torch_stage, mindspore_stage],
            "gpipe",
            micro_batch_num=4,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
        )
    assert torch_stage.generation == 0  # nothing ran


def _float64_numpy(a: Array) -> Any:
    return a.astype(np.float64)


def _float64_tensor(a: Array) -> Any:
    return torch.from_numpy(a).double()


def _float16_tensor(a: Array) -> Any:
    return torch.from_numpy(a).half()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("which", "convert", "dtype", "hint"),
    [
        ("inputs", _float64_numpy, "float64", "inputs.astype(np.float32)"),
        ("inputs", _float64_tensor, "float64", "inputs.to(torch.float32)"),
        ("targets", _float16_tensor, "float16", "targets.to(torch.float32)"),
    ],
)
async def test_a_batch_of_the_wrong_float_dtype_is_refused(
    which: str, convert: Callable[[Array], Any], dtype: str, hint: str
) -> None:
    """float32 stages refuse a float64 or float16 batch (numpy or torch) before running:
    a PipelineInputError naming the batch, the expected and the given dtype, and how to
    convert it in the batch's own framework."""
    stages = build_stages(2)
    x, y = make_data()
    batches = {"inputs": x, "targets": y}
    batches[which] = convert(batches[which])
    with pytest.raises(
        PipelineInputError, match=rf"{which} must have dtype float32 .*got {dtype}"
    ) as caught:
        await run_case(stages, GPIPE_CASE, swap=True, **batches)
    assert f"(e.g. {hint})" in str(caught.value)
    assert all(s.generation == 0 for s in stages)


def _elementwise(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output - target) ** 2


def _python_float(output: torch.Tensor, target: torch.Tensor) -> Any:
    return float(((output - target) ** 2).mean().detach())


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("loss_fn", "got"),
    [(_elementwise, "got Tensor of shape (2, 4, 8)"), (_python_float, "got float\n")],
)
async def test_a_loss_fn_that_returns_no_scalar_tensor_is_named(
    loss_fn: Callable[[torch.Tensor, torch.Tensor], Any], got: str
) -> None:
    """A loss_fn returning a non-scalar tensor (or no tensor) ends the run at the last
    stage's first forward, naming the loss_fn and what it returned."""
    stages = build_stages(2)
    with pytest.raises(PipelineError) as caught:
        await run_case(stages, GPIPE_CASE, swap=True, loss_fn=loss_fn)
    message, cause = str(caught.value), caught.value.__cause__
    assert (caught.value.rank, caught.value.step) == (1, "F0.1")
    del caught
    assert isinstance(cause, PipelineInputError)
    assert f"loss_fn {loss_fn.__qualname__} must return a scalar torch.Tensor (shape ())" in message
    assert got in message + "\n"
    assert stage_runs_holding_chunks() == 0


class _Pair(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner(x), x


@pytest.mark.asyncio
async def test_a_tuple_the_next_stage_cannot_take_is_named() -> None:
    """A stage returns two tensors to a module that takes one: reported at the receiving
    stage's first forward, naming it and what it received (``test_torch_tuples.py`` has
    tuples that work); no chunk is left behind, and the stages run again."""
    stages = build_stages(2)
    paired = [PipelineStage(_Pair(stages[0].module), 0, 2), stages[1]]
    with pytest.raises(PipelineError) as caught:
        await run_case(paired, GPIPE_CASE, swap=True)
    assert (caught.value.rank, caught.value.step) == (1, "F0.1")
    cause = caught.value.__cause__
    assert isinstance(cause, PipelineInputError)
    assert (
        "stage 1's module raised TypeError when called with the 2 tensors stage 0 returned"
        in str(cause)
    )
    del caught
    assert stage_runs_holding_chunks() == 0
