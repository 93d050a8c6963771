"""Swap on is bit-identical to swap off, and both equal one unsplit model, on both
backends: every schedule family (GPipe, 1F1B, Interleaved 1F1B at pp=2 vpp=2 and pp=4
vpp=2) with and without the dx/dw split and real overlap, in every P2P mode, and Looped
BFS, Interleaved Zero Bubble, ZBV and DualPipeV (the V schedules place stage ``s`` on
rank ``s`` and ``2 * pp - 1 - s``: rank 0 runs the first and the last stage, and the last
rank hands its first-leg output to itself at the V's turn), in process, CPU, float32, on
swap-wrapped stages (torch: an attention block, which saves transposed
views at storage offsets, and an MLP block, ``tests/torch_backend/torch_support.py``;
MindSpore: the demo's MLP, ``ppswap.demo.model``). Per rank, swap must have moved bytes
exactly where the plan swaps, loaded them all back and lowered the measured peak where the
plan predicts a cut (the torch twin's FSDP and repeated-run cases:
``tests/torch_backend/test_torch_equivalence.py``, ``test_torch_new_schedules.py``). A
family's orders given as torch's CSV run as the family; a configuration a family cannot
serve and a bad given order are refused before anything runs.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from backend_runs import BackendRuns, runs_of
from stage_runs import stage_runs_holding_chunks

from ppswap import RunResult, run_schedule
from ppswap.scheduler.config import SavedUntil, ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.simulate import memory_table
from ppswap.scheduler.swap_plan import eligible_chunks
from ppswap.scheduler.user_orders import write_csv

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch_backend"))

Array = npt.NDArray[Any]
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True)
class Case:
    schedule: str
    pp: int
    stage_num: int
    micro: int
    split_dw: bool = False
    overlap_b_f: bool = False
    p2p: str = "plain"

    def config(self) -> ScheduleConfig:
        return ScheduleConfig(
            schedule=self.schedule,
            pp=self.pp,
            vpp=self.stage_num // self.pp,
            micro=self.micro,
            split_dw=self.split_dw,
            overlap_b_f=self.overlap_b_f,
            p2p=self.p2p,
            swap=True,
        )

    def label(self) -> str:
        flags = [f"pp{self.pp}", f"s{self.stage_num}", f"m{self.micro}", self.p2p]
        flags += ["dw"] * self.split_dw + ["overlap"] * self.overlap_b_f
        return f"{self.schedule}-{'-'.join(flags)}"


FAMILIES = [
    Case("gpipe", pp=2, stage_num=2, micro=4),
    Case("1f1b", pp=4, stage_num=4, micro=8),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4),
]
FLAGS = [(False, False), (True, False), (False, True), (True, True)]
INTERLEAVED_PP4 = Case("interleaved_1f1b", pp=4, stage_num=8, micro=8)
CASES = [
    # Every family with and without the dx/dw split and real overlap, in every P2P mode
    # (GPipe has no steady state to overlap: ScheduleConfig refuses it)...
    *(
        replace(family, split_dw=split_dw, overlap_b_f=overlap, p2p=p2p)
        for family in FAMILIES
        for split_dw, overlap in FLAGS
        if not (family.schedule == "gpipe" and overlap)
        for p2p in ("plain", "batch", "boundary")
    ),
    # ... and Interleaved at pp=4, the slowest, in two.
    INTERLEAVED_PP4,
    replace(INTERLEAVED_PP4, overlap_b_f=True, p2p="batch"),
    # The zero-bubble, V and looped families, each P2P mode at least once.
    Case("looped_bfs", pp=2, stage_num=4, micro=4),
    Case("interleaved_zb", pp=2, stage_num=4, micro=4),
    Case("interleaved_zb", pp=2, stage_num=4, micro=4, p2p="batch"),
    Case("zbv", pp=2, stage_num=4, micro=4),
    Case("zbv", pp=2, stage_num=4, micro=2, p2p="boundary"),  # micro < 2 * pp - 1
    Case("zbv", pp=4, stage_num=8, micro=8, p2p="batch"),
    Case("dualpipev", pp=2, stage_num=4, micro=4),
    Case("dualpipev", pp=2, stage_num=4, micro=4, p2p="boundary"),
    Case("dualpipev", pp=3, stage_num=6, micro=8, p2p="batch"),
    Case("dualpipev", pp=4, stage_num=8, micro=8),
    Case("dualpipev", pp=4, stage_num=8, micro=8, p2p="boundary"),
]


@dataclass(frozen=True)
class Prediction:
    """What the swap plan says about one rank: whether it swaps a chunk and whether that
    lowers its peak of resident chunks."""

    eligible: bool
    cuts_peak: bool


def predictions(case: Case, saved_until: SavedUntil) -> list[Prediction]:
    """Per rank, from the lowered orders, with the backend's release point of a split
    chunk (torch holds it until its BWD_WEIGHT, MindSpore until its BWD_INPUT)."""
    config = case.config()
    orders = build_all_orders(config)
    table = memory_table(replace(config, saved_until=saved_until))
    return [
        Prediction(
            eligible=bool(eligible_chunks(order)),
            cuts_peak=row["peak_chunks_swap"] < row["peak_chunks_no_swap"],
        )
        for row, order in zip(table, orders, strict=True)
    ]


async def run(runs: BackendRuns, case: Case, swap: bool) -> Any:
    stages = runs.stages(case.stage_num)
    x, y = runs.data()
    result: RunResult = await run_schedule(
        stages,
        case.schedule,
        micro_batch_num=case.micro,
        inputs=x,
        targets=y,
        loss_fn=runs.loss_fn,
        swap=swap,
        pp=case.pp,
        split_dw=case.split_dw,
        overlap_b_f=case.overlap_b_f,
        p2p=case.p2p,
        step_timeout=60.0,
    )
    return stages, result, runs.grads(stages)


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=Case.label)
async def test_swap_is_bit_identical_and_matches_unsplit(backend: str, case: Case) -> None:
    """Losses and every gradient bit-identical with and without swap; equal to the unsplit
    model within rtol 1e-5; per rank, bytes moved exactly where the plan swaps, all of
    them loaded back, nothing left held, and a lower measured peak where the plan
    predicts one (no higher one under overlap_b_f, whose leaf order follows timing)."""
    runs = runs_of(backend)
    stages, base, base_grads = await run(runs, case, swap=False)
    _, swapped, swap_grads = await run(runs, case, swap=True)

    assert len(base.losses) == case.micro
    assert swapped.losses == base.losses  # bit-identical floats
    assert len(base_grads) == len(swap_grads) == case.stage_num
    for index, (stage_base, stage_swap) in enumerate(zip(base_grads, swap_grads, strict=True)):
        assert len(stage_base) == len(stage_swap)
        for g0, g1 in zip(stage_base, stage_swap, strict=True):
            assert g0.dtype == g1.dtype
            np.testing.assert_array_equal(g0, g1, err_msg=f"stage {index}")

    ref_loss, ref_grads = runs.unsplit(stages)
    assert base.loss == pytest.approx(ref_loss, rel=RTOL)
    for stage_ref, stage_run in zip(ref_grads, base_grads, strict=True):
        for g_ref, g_run in zip(stage_ref, stage_run, strict=True):
            assert g_run.shape == g_ref.shape and g_run.dtype == g_ref.dtype
            np.testing.assert_allclose(g_run, g_ref, rtol=RTOL, atol=ATOL)

    plan = predictions(case, runs.saved_until)
    assert any(p.eligible for p in plan), "the case must exercise swap"
    for p, off, on in zip(plan, base.ranks, swapped.ranks, strict=True):
        assert off.offloaded_bytes == off.loaded_bytes == 0
        assert (on.offloaded_bytes > 0) == p.eligible, (on.rank, p)
        assert on.loaded_bytes == on.offloaded_bytes
        assert on.groups_left == on.saved_bytes_left == 0
        if p.cuts_peak and case.overlap_b_f:
            # The runtime runs whichever leaf of an OVERLAP_B_F composite is ready first,
            # so each run's measured peak may sit a chunk below the planned one (which
            # counts both): the two runs' leaf orders differ with the host's timing.
            assert on.peak_saved_bytes <= off.peak_saved_bytes, (on.rank, p)
        elif p.cuts_peak:
            assert on.peak_saved_bytes < off.peak_saved_bytes, (on.rank, p)
    assert stage_runs_holding_chunks() == 0


@pytest.mark.asyncio
async def test_gpipe_with_overlap_is_refused_before_running(backend: str) -> None:
    runs = runs_of(backend)
    stages = runs.stages(2)
    x, y = runs.data()
    with pytest.raises(ValueError, match="overlap_b_f"):
        await run_schedule(
            stages,
            "gpipe",
            micro_batch_num=4,
            inputs=x,
            targets=y,
            loss_fn=runs.loss_fn,
            overlap_b_f=True,
        )
    assert all(s.generation == 0 for s in stages)


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
    backend: str, schedule: str, pp: int, stage_num: int, micro: int, message: str
) -> None:
    runs = runs_of(backend)
    stages = runs.stages(stage_num)
    x, y = runs.data()
    # refused by the schedule's rules, before the data (8 rows, not divisible by 5) is read
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        await run_schedule(
            stages,
            schedule,
            micro_batch_num=micro,
            inputs=x,
            targets=y,
            loss_fn=runs.loss_fn,
            pp=pp,
        )
    assert all(s.generation == 0 for s in stages)
    assert stage_runs_holding_chunks() == 0


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("schedule", "pp", "stage_num", "micro"), [("zbv", 2, 4, 4), ("dualpipev", 2, 4, 4)]
)
async def test_a_given_order_runs_as_the_family_it_spells(
    backend: str, schedule: str, pp: int, stage_num: int, micro: int, tmp_path: Path
) -> None:
    """The family's orders written as torch's CSV and given as ``order=``: with swap, the
    same losses and gradients bit for bit as the family run by name (pp from the rows)."""
    runs = runs_of(backend)
    config = ScheduleConfig(schedule=schedule, pp=pp, vpp=stage_num // pp, micro=micro)
    path = tmp_path / "order.csv"
    write_csv([compute_order(config, rank) for rank in range(pp)], path)
    x, y = runs.data()
    grads = []
    losses = []
    for spec in ({"schedule": schedule, "pp": pp}, {"order": path}):
        stages = runs.stages(stage_num)
        result = await run_schedule(
            stages,
            micro_batch_num=micro,
            inputs=x,
            targets=y,
            loss_fn=runs.loss_fn,
            swap=True,
            step_timeout=60,
            **spec,
        )
        assert sum(r.offloaded_bytes for r in result.ranks) > 0
        losses.append(result.losses)
        grads.append(runs.grads(stages))
    assert losses[0] == losses[1]
    for stage_a, stage_b in zip(*grads, strict=True):
        for g0, g1 in zip(stage_a, stage_b, strict=True):
            np.testing.assert_array_equal(g0, g1)


@pytest.mark.asyncio
async def test_a_bad_given_order_is_refused_before_running(backend: str) -> None:
    runs = runs_of(backend)
    stages = runs.stages(2)
    x, y = runs.data()
    rows = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1", "1B1"]]
    with pytest.raises(ValueError, match=r"^order rank 1 position 4 \(1B1\): repeated"):
        await run_schedule(
            stages, micro_batch_num=2, inputs=x, targets=y, loss_fn=runs.loss_fn, order=rows
        )
    assert all(s.generation == 0 for s in stages)
    assert stage_runs_holding_chunks() == 0
