"""Text grids of per-rank orders."""

from __future__ import annotations

import re

import pytest

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.render import STEP_DESCRIPTIONS, format_grid, step_legend
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


def _cells_of(text: str, rank: int) -> list[str]:
    """Every cell of ``rank``'s row, over all the blocks of a folded grid."""
    cells: list[str] = []
    for line in text.splitlines():
        label, _, row = line.partition("|")
        if label.strip() == f"rank {rank}":
            cells += row.split()
    return cells


def test_width_folds_the_aligned_grid_into_labelled_blocks() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=3, micro=8, swap=True)
    orders = build_all_orders(config)
    text = format_grid(orders, compact=False, width=60)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 60
    labels = [line for line in lines if line.startswith("step")]
    columns = max(len(order) for order in orders)
    assert labels[0].startswith("steps 0-") and labels[0].endswith(f" of {columns}:")
    for rank, order in enumerate(orders):  # every step is still there, in order
        assert _cells_of(text, rank) == [step.short() for step in order]
    # unfolded when it fits, and with width=None
    assert format_grid(ORDERS, compact=False, width=200) == format_grid(ORDERS, compact=False)
    assert len(format_grid(orders, compact=False).splitlines()) == 1 + len(orders)


def test_a_cell_wider_than_width_gets_a_block_of_its_own() -> None:
    text = format_grid(ORDERS, compact=False, width=5)
    assert "step 0 of 4:" in text.splitlines()
    assert _cells_of(text, 1) == ["F0.1", "B0.1", "F1.1", "B1.1"]


@pytest.mark.parametrize("width", [0, -3, 2.5, True])
def test_bad_width_is_refused(width: object) -> None:
    with pytest.raises(ValueError, match="width must be None or an int >= 1"):
        format_grid(ORDERS, compact=False, width=width)  # type: ignore[arg-type]


def test_every_step_kind_has_a_description() -> None:
    assert set(STEP_DESCRIPTIONS) == set(StepKind)
    assert all(text and text == text.strip() for text in STEP_DESCRIPTIONS.values())


def test_legend_lists_exactly_the_codes_that_appear() -> None:
    config = ScheduleConfig(
        schedule="1f1b", pp=2, micro=4, p2p="batch", overlap_b_f=True, split_dw=True, fsdp=True
    )
    orders = build_all_orders(config)
    legend = step_legend(orders).splitlines()
    entries = {line.split()[0]: line for line in legend if line.startswith("  ")}
    grid_codes = set(re.findall(r"[A-Z]+", format_grid(orders)))
    assert set(entries) == grid_codes
    assert entries["OBF"].split()[1] == "OVERLAP_B_F"
    assert STEP_DESCRIPTIONS[StepKind.FSDP_UNSHARD] in entries["UN"]
    assert "A chunk" not in step_legend(orders)  # no swap step, no chunk sentence
    assert all(len(line) <= 100 for line in legend)


def test_legend_codes_are_those_of_metastep_short() -> None:
    orders = build_all_orders(ScheduleConfig(schedule="gpipe", pp=2, micro=6, swap=True))
    legend = step_legend(orders, width=60)
    assert all(len(line) <= 60 for line in legend.splitlines())
    for kind, code in [
        (StepKind.SWAP_LAUNCH_OFFLOAD, "LO"),
        (StepKind.SWAP_WAIT_OFFLOAD, "WO"),
        (StepKind.SWAP_LAUNCH_LOAD, "LL"),
        (StepKind.SWAP_WAIT_LOAD, "WL"),
    ]:
        assert MetaStep(kind, 0, 3).short() == f"{code}3.0"
        assert re.search(rf"^  {code} +{kind.value} ", legend, re.MULTILINE)
    with pytest.raises(ValueError, match="width must be an int >= 40, got 10"):
        step_legend(orders, width=10)
