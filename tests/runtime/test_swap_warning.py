"""A run with ``swap=True`` whose stages mark nothing says so: one ``SwapWarning`` per
run naming the stages (``ppswap/swap/unmarked.py``), on MindSpore and on torch; a run
whose stages mark their blocks gets none."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ppswap import PipelineStage, ScheduleGPipe, SwapWarning
from ppswap.swap import swap_wrapper

STAGE_NUM, MICRO, BATCH, DIM = 2, 8, 16, 16


def _mindspore_stages(marked: bool) -> tuple[list[Any], Callable[..., Any]]:
    pytest.importorskip("mindspore")
    from ppswap.demo.model import build_mlp_stages, mse_loss

    wrap = swap_wrapper if marked else None
    return build_mlp_stages(STAGE_NUM, dim=DIM, wrap=wrap), mse_loss


def _torch_stages(marked: bool) -> tuple[list[Any], Callable[..., Any]]:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    def block() -> Any:
        layers = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.Tanh())
        return swap_wrapper(layers) if marked else layers

    modules = [torch.nn.Sequential(block(), torch.nn.Linear(4 * DIM, DIM)) for _ in range(2)]
    return modules, torch.nn.functional.mse_loss


BUILDERS = [
    pytest.param(_mindspore_stages, marks=pytest.mark.mindspore, id="mindspore"),
    pytest.param(_torch_stages, id="torch"),
]


def _runs(
    build: Callable[[bool], tuple[list[Any], Callable[..., Any]]], *, marked: bool, runs: int
) -> tuple[list[str], list[int]]:
    """The SwapWarnings of ``runs`` GPipe runs with swap on (every warning recorded), and
    every rank's offloaded bytes of the last run."""
    modules, loss_fn = build(marked)
    stages = [PipelineStage(m, i, STAGE_NUM) for i, m in enumerate(modules)]
    schedule = ScheduleGPipe(stages, MICRO, loss_fn=loss_fn, swap=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    y = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(runs):
            result = schedule.run(x, targets=y)
    swap_warnings = [str(w.message) for w in caught if issubclass(w.category, SwapWarning)]
    return swap_warnings, [rank.offloaded_bytes for rank in result.ranks]


@pytest.mark.parametrize("build", BUILDERS)
def test_swap_on_with_nothing_marked_warns_once_per_run(
    build: Callable[[bool], tuple[list[Any], Callable[..., Any]]],
) -> None:
    messages, offloaded = _runs(build, marked=False, runs=2)
    assert offloaded == [0, 0]
    assert len(messages) == 2  # one per run, not one per rank or chunk
    assert messages[0] == messages[1]
    assert messages[0].startswith("swap=True moved nothing on stages 0, 1: their forwards")
    assert "swap_wrapper" in messages[0]


@pytest.mark.parametrize("build", BUILDERS)
def test_swap_on_with_marked_blocks_does_not_warn(
    build: Callable[[bool], tuple[list[Any], Callable[..., Any]]],
) -> None:
    messages, offloaded = _runs(build, marked=True, runs=1)
    assert all(moved > 0 for moved in offloaded)
    assert messages == []
