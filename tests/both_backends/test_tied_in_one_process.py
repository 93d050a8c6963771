"""Tied parameters in one process, on both backends (``ppswap/planning/ties.py``,
``tie_sum.py``): a GPT-2 style model whose head multiplies by the input embedding's
weight (``tests/tied_model.py`` on torch, ``tests/tied_cells.py`` on MindSpore; the torch
refusals, FSDP and the sum's step: ``tests/torch_backend/test_torch_tied.py``; across
processes: ``tests/across_processes/test_tied_across_processes.py``).

Held as one object by the first and the last stage (found by identity) or as two copies
declared ``tied`` (the same key on both): the loss and every gradient equal the unsplit
model's, both holders' ``stage.grads`` entries are the whole gradient, bit for bit the
same, and on torch ``.grad`` gets it once. Swap on is bit-identical to swap off; the
schedules (GPipe, 1F1B, Interleaved, ZBV, where both holders are virtual stages of one
rank), the dx/dw split and overlap all sum alike.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import tied_model
import torch

from ppswap import PipelineStage, run_schedule

Array = npt.NDArray[Any]

CASES: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "gpipe-pp2": ("gpipe", 2, 2, {}),
    "gpipe-pp4": ("gpipe", 4, 4, {}),
    "1f1b-pp2-split-dw": ("1f1b", 2, 2, {"split_dw": True}),
    "interleaved-pp2": ("interleaved_1f1b", 2, 4, {}),
    "interleaved-pp2-overlap": ("interleaved_1f1b", 2, 4, {"overlap_b_f": True}),
    "zbv-pp2": ("zbv", 2, 4, {}),
}


@dataclass(frozen=True)
class Tolerance:
    loss_rtol: float
    rtol: float
    atol: float


class TorchTied:
    """``tests/tied_model.py``: token ids, an embedding and cross entropy."""

    tolerance = Tolerance(loss_rtol=1e-6, rtol=1e-5, atol=1e-7)

    def stages(self, stage_num: int, how: str) -> list[PipelineStage]:
        modules = tied_model.tied_modules(stage_num, shared=how == "shared")
        declared = how == "declared"
        tied = {0: tied_model.TIED[0], stage_num - 1: tied_model.TIED[-1]} if declared else {}
        return [PipelineStage(m, i, stage_num, tied=tied.get(i)) for i, m in enumerate(modules)]

    def data(self) -> tuple[Any, Any, Any]:
        x, y = tied_model.tokens()
        return x, y, tied_model.lm_loss

    def unsplit(self, stage_num: int) -> tuple[float, list[list[Array]]]:
        loss, grads = tied_model.unsplit(stage_num)
        return loss, [[g.numpy() for g in row] for row in grads]

    def tied_indices(self, first: PipelineStage, last: PipelineStage) -> tuple[int, int]:
        return (
            index_of(first.parameters, first.module.wte.weight),
            index_of(last.parameters, last.module.head.weight),
        )

    def numpy(self, grad: Any) -> Array:
        array: Array = grad.numpy().copy()
        return array

    def check_grad_attributes(self, stages: Sequence[PipelineStage], how: str) -> None:
        """``.grad``: the sum once (not twice where the object is one); two declared
        copies each their own tensor."""
        first, last = stages[0], stages[-1]
        for param, grad in zip(first.parameters, first.grads, strict=True):
            assert param.grad is not None and torch.equal(param.grad, grad)
        k_first, _ = self.tied_indices(first, last)
        head = last.module.head.weight
        assert head.grad is not None and torch.equal(head.grad, first.grads[k_first])
        if how == "declared":
            assert head.grad is not first.module.wte.weight.grad


class MindSporeTied:
    """``tests/tied_cells.py``: one-hot inputs, a projection by ``wte`` and a squared
    error (MindSpore Parameters have no ``.grad``)."""

    tolerance = Tolerance(loss_rtol=1e-5, rtol=1e-5, atol=1e-6)

    def __init__(self) -> None:
        self.cells = importlib.import_module("tied_cells")

    def stages(self, stage_num: int, how: str) -> list[PipelineStage]:
        modules = self.cells.cells(stage_num, shared=how == "shared")
        declared = how == "declared"
        return [
            PipelineStage(
                m, i, stage_num, tied=self.cells.declared(i, stage_num) if declared else None
            )
            for i, m in enumerate(modules)
        ]

    def data(self) -> tuple[Any, Any, Any]:
        x, y = self.cells.data()
        return x, y, self.cells.mse_loss

    def unsplit(self, stage_num: int) -> tuple[float, list[list[Array]]]:
        loss, grads = self.cells.unsplit(stage_num)
        return loss, grads

    def tied_indices(self, first: PipelineStage, last: PipelineStage) -> tuple[int, int]:
        return (
            self.cells.tied_index(first.module, first.parameters),
            self.cells.tied_index(last.module, last.parameters),
        )

    def numpy(self, grad: Any) -> Array:
        array: Array = grad.asnumpy()
        return array

    def check_grad_attributes(self, stages: Sequence[PipelineStage], how: str) -> None:
        pass


def index_of(parameters: Sequence[Any], weight: Any) -> int:
    return next(i for i, p in enumerate(parameters) if p is weight)


def tied_backend(backend: str) -> TorchTied | MindSporeTied:
    return TorchTied() if backend == "torch" else MindSporeTied()


@pytest.mark.timeout(240)
@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("how", ["shared", "declared"])
async def test_a_tied_model_equals_the_unsplit_one(backend: str, case: str, how: str) -> None:
    model = tied_backend(backend)
    tolerance = model.tolerance
    schedule, pp, stage_num, options = CASES[case]
    want_loss, want = model.unsplit(stage_num)
    runs = []
    for swap in (False, True):
        stages = model.stages(stage_num, how)
        x, y, loss_fn = model.data()
        result = await run_schedule(
            stages,
            schedule,
            pp=pp,
            micro_batch_num=4,
            inputs=x,
            targets=y,
            loss_fn=loss_fn,
            swap=swap,
            step_timeout=120.0,
            **options,
        )
        assert result.loss == pytest.approx(want_loss, rel=tolerance.loss_rtol)
        first, last = stages[0], stages[-1]
        k_first, k_last = model.tied_indices(first, last)
        # the whole gradient on both holders, the same bits
        tied_first = model.numpy(first.grads[k_first])
        assert np.array_equal(tied_first, model.numpy(last.grads[k_last]))
        # the unsplit model's gradients (its head is the embedding's object: the sum)
        for stage, reference in zip(stages, want, strict=True):
            for grad, expected in zip(stage.grads, reference, strict=True):
                got = model.numpy(grad)
                assert got.shape == expected.shape
                np.testing.assert_allclose(got, expected, rtol=tolerance.rtol, atol=tolerance.atol)
        model.check_grad_attributes(stages, how)
        runs.append([model.numpy(g) for s in stages for g in s.grads])
    off, on = runs  # swap on bit-identical to swap off
    assert len(off) == len(on)
    assert all(a.dtype == b.dtype and np.array_equal(a, b) for a, b in zip(off, on, strict=True))
