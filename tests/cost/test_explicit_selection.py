"""``inject_swap_steps(..., chunks=)``: an explicit selection placed by the gap rule's anchors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_exec_order
from ppswap.scheduler.swap_plan import (
    eligible_chunks,
    inject_swap_steps,
    plan_swap,
    select_chunks,
    strip_swap_steps,
)

CONFIG = ScheduleConfig(schedule="1f1b", pp=4, micro=8, swap=True)


def plain(rank: int) -> tuple:
    return build_exec_order(replace(CONFIG, swap=False), rank)


def test_the_fixed_rules_chunks_give_the_fixed_rules_order() -> None:
    for rank in range(CONFIG.pp):
        fixed = build_exec_order(CONFIG, rank)
        chosen = inject_swap_steps(plain(rank), CONFIG, rank, chunks=eligible_chunks(fixed))
        assert chosen == fixed


def test_no_chunks_gives_the_plain_order() -> None:
    assert inject_swap_steps(plain(0), CONFIG, 0, chunks=()) == plain(0)


def test_a_subset_keeps_the_anchors_of_the_chosen_chunks() -> None:
    fixed = build_exec_order(CONFIG, 0)
    keep = set(sorted(eligible_chunks(fixed))[::2])
    assert len(keep) >= 2
    chosen = inject_swap_steps(plain(0), CONFIG, 0, chunks=keep)
    assert eligible_chunks(chosen) == keep
    assert strip_swap_steps(chosen) == plain(0)
    # every kept swap step sits in the same gap between compute slots as in the fixed order
    assert swap_gaps(chosen) == [item for item in swap_gaps(fixed) if item[0].chunk in keep]


def swap_gaps(order: tuple) -> list:
    """Each swap step with the number of compute slots before it."""
    out, slots = [], 0
    for step in order:
        if step.is_compute:
            slots += 1
        elif step.is_swap:
            out.append((step, slots))
    return out


def test_a_gap_below_the_threshold_can_be_chosen_explicitly() -> None:
    plans = {p.chunk: p for p in plan_swap(plain(2), CONFIG)}
    short = next(chunk for chunk, p in plans.items() if 2 <= p.gap < CONFIG.min_swap_gap)
    assert not eligible_chunks(build_exec_order(CONFIG, 2))
    chosen = inject_swap_steps(plain(2), CONFIG, 2, chunks={short})
    assert eligible_chunks(chosen) == {short}


def test_other_ranks_chunks_are_ignored() -> None:
    everything = eligible_chunks(build_exec_order(CONFIG, 0)) | eligible_chunks(
        build_exec_order(CONFIG, 1)
    )
    for rank in range(CONFIG.pp):
        assert inject_swap_steps(plain(rank), CONFIG, rank, chunks=everything) == (
            build_exec_order(CONFIG, rank)
        )


def test_swap_off_ignores_the_selection() -> None:
    config = replace(CONFIG, swap=False)
    assert inject_swap_steps(plain(0), config, 0, chunks={(0, 0)}) == plain(0)


@pytest.mark.parametrize(
    ("chunks", "error", "match"),
    [
        ({(0, 99)}, ValueError, r"\(stage, micro\) = \(0, 99\), which this order does not run"),
        ("01", TypeError, "chunks must be a collection of"),
        (5, TypeError, "chunks must be a collection of"),
        ({(0,)}, TypeError, r"chunks must hold \(stage, micro\) int pairs, got \(0,\)"),
        ({(0, "1")}, TypeError, "int pairs"),
    ],
)
def test_bad_selections_are_refused(chunks: object, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        inject_swap_steps(plain(0), CONFIG, 0, chunks=chunks)  # type: ignore[arg-type]


def test_a_chunk_without_room_for_four_steps_is_refused() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=1, micro=3, swap=True)
    order = build_exec_order(replace(config, swap=False), 0)
    tight = next(p.chunk for p in plan_swap(order, config) if p.gap < 2)
    assert tight == (0, 0)
    with pytest.raises(ValueError, match=r"= \(0, 0\) with gap 1; a swapped chunk needs gap >= 2"):
        select_chunks(plan_swap(order, config), {tight}, config.stages_of(0))
