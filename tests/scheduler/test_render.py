"""Text grids of per-rank orders."""

from __future__ import annotations

import pytest

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.render import format_grid
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.steps import MetaStep, StepKind

CONFIG = ScheduleConfig(schedule="1f1b", pp=2, micro=2)
ORDERS = tuple(compute_order(CONFIG, rank) for rank in range(2))


def test_compact_grid_lists_each_rank_on_one_line() -> None:
    assert format_grid(ORDERS) == "rank 0 | F0.0 F1.0 B0.0 B1.0\nrank 1 | F0.1 B0.1 F1.1 B1.1"


def test_aligned_grid_lines_up_step_positions() -> None:
    orders = (
        ORDERS[0],
        (MetaStep(StepKind.FSDP_UNSHARD, 1, -1), *ORDERS[1]),
    )
    lines = format_grid(orders, compact=False).splitlines()
    assert lines[0].split() == ["step", "|", "0", "1", "2", "3", "4"]
    # column 1 starts at the same offset in every row
    assert lines[1].index("F1.0") == lines[2].index("F0.1") == lines[0].index("1 ")
    assert lines[2].endswith("B1.1")


def test_marks_and_windows() -> None:
    marked = format_grid(ORDERS, marks={1: 2})
    assert "rank 1 | F0.1 B0.1 >>F1.1 B1.1" in marked
    window = format_grid(ORDERS, marks={0: 3, 1: 0}, window=1)
    assert window.splitlines() == ["rank 0 | ... B0.0 >>B1.0", "rank 1 | >>F0.1 B0.1 ..."]
    assert ">>(end)" in format_grid(ORDERS, marks={0: 4})


def test_bad_window_is_refused() -> None:
    with pytest.raises(ValueError, match="window must be None or an int >= 0, got -1"):
        format_grid(ORDERS, window=-1)
