"""A loss without targets is refused before anything runs, in one line that says a loss
needs targets (not a complaint about the type of ``None``), on MindSpore and on torch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ppswap import PipelineInputError, PipelineStage, ScheduleGPipe

DIM = 8


def _mindspore_stages() -> tuple[list[Any], Callable[..., Any]]:
    pytest.importorskip("mindspore")
    from ppswap.demo.model import build_mlp_stages, mse_loss

    return build_mlp_stages(2, dim=DIM), mse_loss


def _torch_stages() -> tuple[list[Any], Callable[..., Any]]:
    torch = pytest.importorskip("torch")
    return [torch.nn.Linear(DIM, DIM) for _ in range(2)], torch.nn.functional.mse_loss


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(_mindspore_stages, marks=pytest.mark.mindspore, id="mindspore"),
        pytest.param(_torch_stages, id="torch"),
    ],
)
def test_loss_fn_without_targets_is_one_line_naming_targets(
    build: Callable[[], tuple[list[Any], Callable[..., Any]]],
) -> None:
    modules, loss_fn = build()
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(modules)]
    x = np.ones((4, DIM), dtype=np.float32)
    schedule = ScheduleGPipe(stages, 2, loss_fn=loss_fn, swap=True)
    with pytest.raises(PipelineInputError) as caught:
        schedule.run(x)
    message = str(caught.value)
    assert message.startswith("targets must be given with loss_fn: the loss of a micro-batch")
    assert "got targets=None" in message and "\n" not in message
    result = schedule.run(x, targets=np.zeros((4, DIM), dtype=np.float32))  # still runs
    assert len(result.losses) == 2
