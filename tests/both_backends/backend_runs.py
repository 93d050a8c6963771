"""Each backend's stages, data, loss and references for the suites parametrized by
backend: :func:`runs_of` gives a :class:`TorchRuns` (the attention + MLP stages of
``tests/torch_backend/torch_support.py``) or a :class:`MindSporeRuns` (the demo's MLP,
``ppswap.demo.model``), with one interface: stages, a batch as numpy arrays, the loss,
gradients as numpy arrays, the unsplit model's loss and gradients.

MindSpore is imported only by ``MindSporeRuns`` (the torch lane has none)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from ppswap import PipelineStage
from ppswap.backends.torch.backend import TorchBackend
from ppswap.scheduler.config import SavedUntil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_backend"))
import torch_support

__all__ = ["BackendRuns", "MindSporeRuns", "TorchRuns", "runs_of"]

Array = npt.NDArray[Any]


class TorchRuns:
    saved_until: SavedUntil = TorchBackend.saved_until

    def stages(self, stage_num: int) -> list[PipelineStage]:
        return torch_support.build_stages(stage_num)

    def data(self) -> tuple[Array, Array]:
        return torch_support.make_data()

    loss_fn = staticmethod(torch_support.mse_loss)

    def grads(self, stages: Sequence[PipelineStage]) -> list[list[Array]]:
        for stage in stages:
            assert all(g.dtype == torch.float32 for g in stage.grads)
        return [[g.detach().numpy().copy() for g in stage.grads] for stage in stages]

    def unsplit(self, stages: Sequence[PipelineStage]) -> tuple[float, list[list[Array]]]:
        x, y = self.data()
        loss, grads = torch_support.unsplit_loss_and_grads([s.module for s in stages], x, y)
        return loss, [[g.numpy() for g in row] for row in grads]


class MindSporeRuns:
    saved_until: SavedUntil = "input"

    def __init__(self) -> None:
        self.model = importlib.import_module("ppswap.demo.model")
        self.swap_wrapper = importlib.import_module("ppswap.swap").swap_wrapper
        backend = importlib.import_module("ppswap.backends.mindspore.backend")
        assert backend.MindSporeBackend.saved_until == self.saved_until

    def stages(self, stage_num: int) -> list[PipelineStage]:
        modules = self.model.build_mlp_stages(stage_num, dim=8, wrap=self.swap_wrapper)
        return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]

    def data(self) -> tuple[Array, Array]:
        rng = np.random.default_rng(1)
        x = rng.standard_normal((8, 8)).astype(np.float32)
        y = rng.standard_normal((8, 8)).astype(np.float32)
        return x, y

    @property
    def loss_fn(self) -> Any:
        return self.model.mse_loss

    def grads(self, stages: Sequence[PipelineStage]) -> list[list[Array]]:
        grads = [[g.asnumpy() for g in stage.grads] for stage in stages]
        assert all(g.dtype == np.float32 for row in grads for g in row)
        return grads

    def unsplit(self, stages: Sequence[PipelineStage]) -> tuple[float, list[list[Array]]]:
        x, y = self.data()
        loss, grads = self.model.unsplit_loss_and_grads(
            [s.module for s in stages], x, y, self.model.mse_loss
        )
        return float(loss), grads


BackendRuns = TorchRuns | MindSporeRuns


def runs_of(backend: str) -> BackendRuns:
    """The runs of ``backend``: ``"torch"`` or ``"mindspore"``."""
    return TorchRuns() if backend == "torch" else MindSporeRuns()
