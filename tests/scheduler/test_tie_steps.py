"""TIED_GRAD_SUM in the plan (``ppswap/scheduler/ties.py``, ``ppswap plan --tie``): the
last step of each rank holding a stage of the tie, none elsewhere; one per tie; refused
ties named in one line."""

from __future__ import annotations

import json

import pytest

from ppswap.cli import main, plan_orders
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import TIED_GRAD_SUM, MetaStep
from ppswap.scheduler.ties import with_tie_steps


def test_each_holder_rank_ends_with_the_sum() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=4, vpp=1, micro=4)
    plain = plan_orders(config)
    tied = plan_orders(config, ties=[(0, 3)])
    assert tied[0] == (*plain[0], MetaStep(TIED_GRAD_SUM, 0, -1))
    assert tied[3] == (*plain[3], MetaStep(TIED_GRAD_SUM, 3, -1))
    assert tied[1:3] == plain[1:3]


def test_two_virtual_stages_of_one_rank_sum_there() -> None:
    """ZBV pp2: stages 0 and 3 both live on rank 0 (the V), so only rank 0 sums."""
    config = ScheduleConfig(schedule="zbv", pp=2, vpp=2, micro=4)
    tied = with_tie_steps(config, plan_orders(config), [(0, 3), (1, 2)])
    assert tied[0][-1:] == (MetaStep(TIED_GRAD_SUM, 3, -1),)
    assert tied[1][-1:] == (MetaStep(TIED_GRAD_SUM, 2, -1),)
    assert tied[0][-1].short() == "TS.s3"


def test_a_bad_tie_is_refused() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, vpp=1, micro=2)
    with pytest.raises(ValueError, match=r"two or more distinct stages in 0\.\.1, got \[0, 5\]"):
        with_tie_steps(config, plan_orders(config), [(0, 5)])


def test_ppswap_plan_shows_the_step(capsys: pytest.CaptureFixture[str]) -> None:
    command = ["plan", "--schedule", "gpipe", "--pp", "2", "--micro", "2"]
    assert main([*command, "--tie", "0,1", "--format", "json"]) == 0
    ranks = json.loads(capsys.readouterr().out)["ranks"]
    for rank in ranks:
        last = rank["steps"][-1]
        assert last == {"kind": "TIED_GRAD_SUM", "stage": rank["rank"], "micro": -1}
    assert main([*command, "--tie", "0"]) != 0
    assert "a tie must name two or more distinct stages in 0..1, got [0]" in capsys.readouterr().err
