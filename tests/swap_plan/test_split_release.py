"""Where a split chunk is released, measured: the memory model in bytes
(``simulate.saved_bytes_profile``) predicts each rank's measured peak of saved bytes to the
byte, with and without swap, on MindSpore (a chunk freed at its BWD_INPUT) and on torch
(freed at its BWD_WEIGHT: a swapped chunk loaded back for its BWD_INPUT stays on device
until its BWD_WEIGHT), for orders whose weight backwards are deferred (Interleaved Zero
Bubble, ZBV, 1F1B with the dx/dw split).

Each run measures what every chunk kept and what its offload moved (``RankStats.
chunk_bytes``); the prediction walks the run's own orders (the gap rule's, planned with the
backend's ``saved_until``) with those sizes. Where the other release point predicts a
different peak (``distinct``: every case, without swap or with it), the measurement
tells the two apart.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

import anyio
import numpy as np
import pytest

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.cli import SAVED_UNTIL_OF_BACKEND
from ppswap.demo.model import build_mlp_stages
from ppswap.demo.model import mse_loss as ms_mse_loss
from ppswap.scheduler.config import SavedUntil, ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.simulate import saved_bytes_profile
from ppswap.swap import swap_wrapper

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_backend"))

from torch_support import build_flat_stages
from torch_support import mse_loss as torch_mse_loss

MICRO = 8
DIM = 8
CASES: dict[str, dict[str, Any]] = {
    "interleaved_zb": dict(schedule="interleaved_zb", pp=2, stage_num=4, distinct=(False, True)),
    # ZBV's no-swap peak is its warm-up's, before any deferred W: only swap tells them apart
    "zbv": dict(schedule="zbv", pp=4, stage_num=8, distinct=(True,)),
    "1f1b-dxdw": dict(schedule="1f1b", pp=2, stage_num=2, split_dw=True, distinct=(False, True)),
}


def _mindspore_stages(stage_num: int) -> list[PipelineStage]:
    modules = build_mlp_stages(stage_num, dim=DIM, wrap=swap_wrapper)
    return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]


BACKENDS: dict[str, tuple[Callable[[int], list[PipelineStage]], Callable[..., Any]]] = {
    "mindspore": (_mindspore_stages, ms_mse_loss),
    "torch": (lambda stage_num: build_flat_stages(stage_num, dim=DIM, blocks=2), torch_mse_loss),
}


def _run(backend: str, case: dict[str, Any], *, swap: bool) -> tuple[RunResult, SavedUntil]:
    make_stages, loss_fn = BACKENDS[backend]
    stages = make_stages(case["stage_num"])
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2 * MICRO, DIM)).astype(np.float32)
    y = rng.standard_normal((2 * MICRO, DIM)).astype(np.float32)

    async def main() -> RunResult:
        return await run_schedule(
            stages,
            case["schedule"],
            pp=case["pp"],
            micro_batch_num=MICRO,
            inputs=x,
            targets=y,
            loss_fn=loss_fn,
            split_dw=bool(case.get("split_dw")),
            swap=swap,
            step_timeout=60.0,
        )

    return anyio.run(main), stages[0].backend.saved_until


def _sizes(result: RunResult, stage_num: int) -> tuple[list[int], list[int]]:
    """Per stage, what a chunk kept and what its offload moved (0: never swapped); every
    chunk of a stage is of one size."""
    kept: dict[int, set[int]] = {}
    moved: dict[int, set[int]] = {}
    for rank in result.ranks:
        for (stage, _), size in rank.chunk_bytes.items():
            kept.setdefault(stage, set()).add(size.held)
            if size.moved is not None:
                moved.setdefault(stage, set()).add(size.moved)
    assert sorted(kept) == list(range(stage_num))
    assert all(len(v) == 1 for v in [*kept.values(), *moved.values()]), (kept, moved)
    return (
        [next(iter(kept[s])) for s in range(stage_num)],
        [next(iter(moved.get(s, {0}))) for s in range(stage_num)],
    )


def _predicted(
    config: ScheduleConfig, kept: list[int], moved: list[int], saved_until: SavedUntil
) -> list[int]:
    return [
        max(
            saved_bytes_profile(
                order, kept=kept, moved=moved, with_swap=config.swap, saved_until=saved_until
            )
        )
        for order in build_all_orders(config)
    ]


@pytest.mark.parametrize("swap", [False, True], ids=["keep", "swap"])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize(
    "backend", [pytest.param("mindspore", marks=pytest.mark.mindspore), "torch"]
)
def test_measured_peak_is_predicted_to_the_byte(backend: str, name: str, swap: bool) -> None:
    case = CASES[name]
    result, saved_until = _run(backend, case, swap=swap)
    assert saved_until == {"mindspore": "input", "torch": "weight"}[backend]
    config = ScheduleConfig(
        schedule=case["schedule"],
        pp=case["pp"],
        vpp=case["stage_num"] // case["pp"],
        micro=MICRO,
        split_dw=bool(case.get("split_dw")),
        swap=swap,
        saved_until=saved_until,
    )
    kept, moved = _sizes(result, case["stage_num"])
    measured = [rank.peak_saved_bytes for rank in result.ranks]
    assert measured == _predicted(config, kept, moved, saved_until)
    if swap and name != "1f1b-dxdw":  # (1F1B at pp2 has no gap long enough to swap)
        assert any(moved)
    if swap in case["distinct"]:
        (other,) = set(get_args(SavedUntil)) - {saved_until}
        assert _predicted(config, kept, moved, other) != measured


@pytest.mark.mindspore
def test_backends_state_their_release_point_once() -> None:
    """``Backend.saved_until`` is ``"weight"`` exactly where the autograd defers dw (the
    runtime then releases a split chunk at BWD_WEIGHT), and ``ppswap plan --backend``
    (which imports no framework) says the same per framework."""
    for name, (make_stages, _) in BACKENDS.items():
        backend = make_stages(1)[0].backend
        assert backend.name == name
        expected = "weight" if backend.autograd.defers_weight_grads else "input"
        assert backend.saved_until == expected == SAVED_UNTIL_OF_BACKEND[name]
