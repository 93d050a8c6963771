"""MindSpore stages under Looped BFS, Interleaved Zero Bubble, ZBV and DualPipeV: swap on
is bit-identical to swap off, both equal the unsplit model (rtol 1e-5), and a
configuration a family cannot serve is refused before anything runs.

A real MindSpore MLP whose blocks are swap-wrapped; the torch counterpart is
``tests/torch_backend/test_torch_new_schedules.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from stage_runs import stage_runs_holding_chunks

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss, unsplit_loss_and_grads
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.user_orders import write_csv
from ppswap.swap import swap_wrapper

DIM = 8
BATCH = 8

CASES = [
    # (schedule, pp, stage_num, micro, p2p)
    ("looped_bfs", 2, 4, 4, "plain"),
    ("interleaved_zb", 2, 4, 4, "batch"),
    ("zbv", 2, 4, 4, "plain"),
    ("zbv", 4, 8, 8, "batch"),
    ("dualpipev", 2, 4, 4, "boundary"),
    ("dualpipev", 4, 8, 8, "plain"),
]


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    y = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    return x, y


def _stages(stage_num: int) -> list[PipelineStage]:
    modules = build_mlp_stages(stage_num, dim=DIM, wrap=swap_wrapper)
    return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]


@pytest.mark.asyncio
@pytest.mark.parametrize(("schedule", "pp", "stage_num", "micro", "p2p"), CASES)
async def test_swap_is_bit_identical_and_matches_unsplit(
    schedule: str, pp: int, stage_num: int, micro: int, p2p: str
) -> None:
    x, y = _data()
    runs = []
    for swap in (False, True):
        stages = _stages(stage_num)
        result = await run_schedule(
            stages,
            schedule,
            micro_batch_num=micro,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=swap,
            pp=pp,
            p2p=p2p,
            step_timeout=60,
        )
        runs.append((stages, result, [[g.asnumpy() for g in s.grads] for s in stages]))
    (stages, base, base_grads), (_, swapped, swap_grads) = runs
    assert len(base.losses) == micro
    assert swapped.losses == base.losses  # bit-identical floats
    for stage_base, stage_swap in zip(base_grads, swap_grads, strict=True):
        for g0, g1 in zip(stage_base, stage_swap, strict=True):
            np.testing.assert_array_equal(g0, g1)
    assert sum(r.offloaded_bytes for r in swapped.ranks) > 0
    assert all(r.offloaded_bytes == r.loaded_bytes for r in swapped.ranks)

    ref_loss, ref_grads = unsplit_loss_and_grads([s.module for s in stages], x, y, mse_loss)
    np.testing.assert_allclose(base.loss, ref_loss, rtol=1e-5)
    for stage_ref, stage_run in zip(ref_grads, base_grads, strict=True):
        for g_ref, g_run in zip(stage_ref, stage_run, strict=True):
            np.testing.assert_allclose(g_run, g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("schedule", "pp", "stage_num", "micro", "message"),
    [
        ("zbv", 2, 6, 4, "vpp must be 2 for zbv (a V: two stages per rank), got 3"),
        ("dualpipev", 4, 4, 8, "vpp must be 2 for dualpipev (a V: two stages per rank), got 1"),
        (
            "dualpipev",
            4,
            8,
            4,
            "micro must be >= 2 * pp = 8 for dualpipev (at least one micro-batch per stage), got 4",
        ),
        (
            "interleaved_zb",
            2,
            4,
            5,
            "micro must be a multiple of its rounds max(1, micro // pp) = 2 for "
            "interleaved_zb with pp=2, got 5",
        ),
    ],
)
async def test_a_configuration_the_family_cannot_serve_is_refused(
    schedule: str, pp: int, stage_num: int, micro: int, message: str
) -> None:
    stages = _stages(stage_num)
    x, y = _data()
    # refused by the schedule's rules, before the data (8 rows, not divisible by 5) is read
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        await run_schedule(
            stages, schedule, micro_batch_num=micro, inputs=x, targets=y, loss_fn=mse_loss, pp=pp
        )
    assert stage_runs_holding_chunks() == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("schedule", "pp", "stage_num", "micro"), [("zbv", 2, 4, 4), ("dualpipev", 2, 4, 4)]
)
async def test_a_given_order_runs_as_the_family_it_spells(
    schedule: str, pp: int, stage_num: int, micro: int, tmp_path: Path
) -> None:
    """The family's orders written as torch's CSV and given as ``order=``: with swap, the
    same losses and gradients bit for bit as the family run by name (pp from the rows)."""
    config = ScheduleConfig(schedule=schedule, pp=pp, vpp=stage_num // pp, micro=micro)  # type: ignore[arg-type]
    path = tmp_path / "order.csv"
    write_csv([compute_order(config, rank) for rank in range(pp)], path)
    x, y = _data()
    grads = []
    losses = []
    for spec in ({"schedule": schedule, "pp": pp}, {"order": path}):
        stages = _stages(stage_num)
        result = await run_schedule(
            stages,
            micro_batch_num=micro,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=True,
            step_timeout=60,
            **spec,
        )
        losses.append(result.losses)
        grads.append([[g.asnumpy() for g in s.grads] for s in stages])
    assert losses[0] == losses[1]
    for stage_a, stage_b in zip(*grads, strict=True):
        for g0, g1 in zip(stage_a, stage_b, strict=True):
            np.testing.assert_array_equal(g0, g1)


@pytest.mark.asyncio
async def test_a_bad_given_order_is_refused_before_running() -> None:
    stages = _stages(2)
    x, y = _data()
    rows = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1", "1B1"]]
    with pytest.raises(ValueError, match=r"^order rank 1 position 4 \(1B1\): repeated"):
        await run_schedule(
            stages, micro_batch_num=2, inputs=x, targets=y, loss_fn=mse_loss, order=rows
        )
    assert stage_runs_holding_chunks() == 0
