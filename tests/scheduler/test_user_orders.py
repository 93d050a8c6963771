"""Orders a user writes in torch's action notation: parsed, checked, written back.

Round trip: every family's orders written in the notation (rows and CSV) read back as
the same MetaSteps. Bad orders: each refused in one line naming the rank, the position
and the action, before anything is lowered.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ppswap.cli import main
from ppswap.scheduler.config import SCHEDULE_NAMES, ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.steps import MetaStep, StepKind
from ppswap.scheduler.user_orders import (
    UserOrderError,
    check_orders_given,
    csv_text,
    format_orders,
    parse_action,
    read_orders,
    write_csv,
)
from ppswap.scheduler.validate import validate_all

CONFIGS = [
    ScheduleConfig(schedule="gpipe", pp=2, micro=3),
    ScheduleConfig(schedule="1f1b", pp=3, micro=4, split_dw=True, overlap_b_f=True),
    ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=4, overlap_b_f=True),
    ScheduleConfig(schedule="looped_bfs", pp=2, vpp=3, micro=3),
    ScheduleConfig(schedule="interleaved_zb", pp=3, vpp=2, micro=6),
    ScheduleConfig(schedule="zbv", pp=3, vpp=2, micro=4),
    ScheduleConfig(schedule="dualpipev", pp=3, vpp=2, micro=7),
]


def _orders(config: ScheduleConfig) -> tuple[tuple[MetaStep, ...], ...]:
    return tuple(compute_order(config, rank) for rank in range(config.pp))


def test_every_schedule_family_is_covered() -> None:
    assert {c.schedule for c in CONFIGS} == set(SCHEDULE_NAMES)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.schedule)
def test_round_trip_is_the_identity(config: ScheduleConfig, tmp_path: Path) -> None:
    orders = _orders(config)
    rows = format_orders(orders)
    assert read_orders(rows) == orders
    assert read_orders(dict(enumerate(rows))) == orders
    path = tmp_path / "order.csv"
    write_csv(orders, path)
    assert path.read_bytes().decode() == csv_text(orders)
    assert read_orders(path) == orders
    assert read_orders(str(path)) == orders
    checked = check_orders_given(orders, config.num_stages, config.micro)
    assert checked.placement == config.placement()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.schedule)
def test_a_given_order_lowers_to_the_familys_orders(config: ScheduleConfig) -> None:
    """The same orders given as a user order lower (FSDP, batch P2P, swap) to the very
    steps the family lowers to, and pass validation and the deadlock proof."""
    given = check_orders_given(_orders(config), config.num_stages, config.micro)
    options = {"fsdp": True, "p2p": "batch", "swap": True}
    family = ScheduleConfig(
        schedule=config.schedule,
        pp=config.pp,
        vpp=config.vpp,
        micro=config.micro,
        split_dw=config.split_dw,
        overlap_b_f=config.overlap_b_f,
        **options,  # type: ignore[arg-type]
    )
    user = ScheduleConfig(pp=config.pp, vpp=config.vpp, micro=config.micro, order=given, **options)  # type: ignore[arg-type]
    assert build_all_orders(user) == build_all_orders(family)
    validate_all(user, build_all_orders(user))


def test_the_notation() -> None:
    assert parse_action("2B1") == MetaStep(StepKind.BWD, 2, 1)
    assert parse_action(" 10I3 ") == MetaStep(StepKind.BWD_INPUT, 10, 3)
    pair = parse_action("(0F3;3B1)OVERLAP_F_B")
    assert pair.kind is StepKind.OVERLAP_F_B
    assert pair.sub_steps == (MetaStep(StepKind.FWD, 0, 3), MetaStep(StepKind.BWD, 3, 1))
    # torch's bubbles (empty cells, None) are skipped
    assert read_orders([["0F0", "", None, "0B0"]]) == (
        (MetaStep(StepKind.FWD, 0, 0), MetaStep(StepKind.BWD, 0, 0)),
    )


GOOD = [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1I1", "1W1"]]


def _replace(rank: int, position: int, cell: str | None) -> list[list[str]]:
    rows = [list(row) for row in GOOD]
    if cell is None:
        del rows[rank][position]
    else:
        rows[rank][position] = cell
    return rows


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        (_replace(0, 1, "0SEND_F1"), "order rank 0 position 1: '0SEND_F1' is not a compute action"),
        (_replace(1, 4, "1X1"), "order rank 1 position 4: '1X1' is not a compute action"),
        (
            _replace(1, 2, "2F1"),
            "order rank 1 position 2 (2F1): unknown stage 2; the stages are 0..1",
        ),
        (_replace(1, 2, "1F5"), "order rank 1 position 2 (1F5): unknown micro-batch 5"),
        (_replace(1, 2, "0F1"), "order rank 1 position 2 (0F1): stage 0 is already run by rank 0"),
        (_replace(0, 3, "0B0"), "order rank 0 position 3 (0B0): repeated (first at position 2)"),
        (_replace(0, 3, None), "order rank 0: missing 0B1 (or 0I1 and 0W1) for 0F1 at position 1"),
        (_replace(1, 4, None), "order rank 1: missing 1W1 for 1I1 at position 3"),
        (_replace(1, 0, None), "order rank 1: missing 1F0 (its backward is at position 0)"),
        (
            [["0F0", "0B0", "0F1", "0B1"], ["1B0", "1F0", "1F1", "1I1", "1W1"]],
            "order rank 1 position 0 (1B0): backward before its forward 1F0 (position 1)",
        ),
        (
            [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1W1", "1I1"]],
            "order rank 1 position 3 (1W1): before its 1I1 (position 4)",
        ),
        (
            # rank 0 waits for stage 1's backward of micro 0 before running forward 1,
            # rank 1 runs forward 1 before that backward: a cycle across the two ranks
            [["0F0", "0B0", "0F1", "0B1"], ["1F0", "1F1", "1B0", "1B1"]],
            "order has a cross-rank cycle: rank 0 position 1 (0B0) waits for stage 1's B or "
            "I of micro-batch 0; rank 1 position 1 (1F1) waits for stage 0's F of micro-batch 1",
        ),
    ],
)
def test_a_bad_order_is_refused_naming_rank_position_and_action(
    rows: list[list[str]], message: str
) -> None:
    with pytest.raises(UserOrderError) as caught:
        check_orders_given(read_orders(rows), num_stages=2, micro=2)
    assert str(caught.value) == message or str(caught.value).startswith(message)
    assert "\n" not in str(caught.value)


def test_a_good_order_passes() -> None:
    given = check_orders_given(read_orders(GOOD), num_stages=2, micro=2)
    assert given.placement == (0, 1)
    config = ScheduleConfig(pp=2, micro=2, order=given, swap=True)
    validate_all(config, build_all_orders(config))


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved_zb", "looped_bfs"])
def test_ppswap_plan_writes_torch_csv_that_reads_back(
    schedule: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "plan",
                "--schedule",
                schedule,
                "--pp",
                "2",
                "--vpp",
                "2",
                "--micro",
                "4",
                "--format",
                "torch-csv",
            ]
        )
        == 0
    )
    config = ScheduleConfig(schedule=schedule, pp=2, vpp=2, micro=4)  # type: ignore[arg-type]
    rows = [line.split(",") for line in capsys.readouterr().out.splitlines()]
    assert read_orders(rows) == _orders(config)
