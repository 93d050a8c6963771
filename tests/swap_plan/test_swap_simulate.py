"""Global logical timeline, bubbles, copy windows and the resident-chunk memory model."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ppswap.cli import main
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.simulate import (
    CopyWindow,
    build_timeline,
    copy_windows,
    memory_profile,
    memory_rows,
    memory_table,
    resident_by_column,
    saved_bytes_profile,
    step_columns,
)
from ppswap.scheduler.steps import MetaStep, Order, StepKind
from ppswap.scheduler.swap_plan import inject_swap_steps
from ppswap.scheduler.validate import ScheduleDeadlockError

K = StepKind

GPIPE = ScheduleConfig(schedule="gpipe", pp=4, micro=8, swap=True)
ONE_F_ONE_B = ScheduleConfig(schedule="1f1b", pp=4, micro=8, swap=True)
INTERLEAVED = ScheduleConfig(schedule="interleaved_1f1b", pp=4, vpp=2, micro=8, swap=True)
OVERLAP = ScheduleConfig(schedule="1f1b", pp=4, micro=8, overlap_b_f=True, swap=True)
OVERLAP_DXDW = ScheduleConfig(
    schedule="1f1b", pp=4, micro=8, overlap_b_f=True, split_dw=True, swap=True
)
NAMED = [GPIPE, ONE_F_ONE_B, INTERLEAVED, OVERLAP, OVERLAP_DXDW]


def gpipe_one_stage_swapped(micro: int = 4) -> tuple[ScheduleConfig, Order]:
    config = ScheduleConfig(schedule="gpipe", pp=1, micro=micro, swap=True)
    order = tuple(MetaStep(K.FWD, 0, i) for i in range(micro)) + tuple(
        MetaStep(K.BWD, 0, i) for i in range(micro)
    )
    return config, inject_swap_steps(order, config, 0)


# -- timeline ----------------------------------------------------------------------------


def test_gpipe_timeline_columns() -> None:
    timeline = build_timeline(GPIPE, build_all_orders(GPIPE))
    # FWD(r, i) at r + i; the last stage's B0 after its F7 (column 10) -> 11, and every
    # earlier stage one column later: BWD(r, i) at 11 + (3 - r) + i.
    assert timeline.num_columns == 22
    for rank, cells in enumerate(timeline.cells):
        fwd = [c.column for c in cells if c.step.kind is K.FWD]
        bwd = [c.column for c in cells if c.step.kind is K.BWD]
        assert fwd == [rank + i for i in range(8)]
        assert bwd == [11 + (3 - rank) + i for i in range(8)]
    assert timeline.bubbles == (6, 6, 6, 6)  # 2 * (pp - 1) per rank


def test_1f1b_has_the_same_bubble_as_gpipe() -> None:
    timeline = build_timeline(ONE_F_ONE_B, build_all_orders(ONE_F_ONE_B))
    assert timeline.num_columns == 22
    assert timeline.bubbles == (6, 6, 6, 6)
    assert timeline.busy_columns(3) == frozenset(range(3, 19))


def test_composite_takes_one_column() -> None:
    orders = build_all_orders(OVERLAP)
    timeline = build_timeline(OVERLAP, orders)
    for rank, cells in enumerate(timeline.cells):
        slots = [s for s in orders[rank] if s.is_compute]
        assert [c.step for c in cells] == slots
        assert len({c.column for c in cells}) == len(cells)
        assert timeline.bubbles[rank] == timeline.num_columns - len(slots)


def test_deadlock_is_reported() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=1)
    orders = (
        (MetaStep(K.FWD, 0, 0), MetaStep(K.BWD, 0, 0)),
        (MetaStep(K.BWD, 1, 0), MetaStep(K.FWD, 1, 0)),  # BWD before its own FWD
    )
    with pytest.raises(ScheduleDeadlockError, match=r"rank 0 at B0\.0, rank 1 at B0\.1") as info:
        build_timeline(config, orders)
    assert info.value.stuck == {0: 1, 1: 0}


def test_missing_dependency_is_reported() -> None:
    config = ScheduleConfig(schedule="gpipe", pp=2, micro=1)
    orders: tuple[Order, ...] = ((), (MetaStep(K.FWD, 1, 0), MetaStep(K.BWD, 1, 0)))
    with pytest.raises(ValueError, match=r"depends on FWD\(stage=0, micro=0\), which no rank"):
        build_timeline(config, orders)


def test_orders_must_match_pp() -> None:
    with pytest.raises(ValueError, match="one order per rank"):
        build_timeline(GPIPE, build_all_orders(GPIPE)[:3])


# -- memory model ------------------------------------------------------------------------


def test_memory_profile_by_hand() -> None:
    _, order = gpipe_one_stage_swapped()
    assert " ".join(s.short() for s in order) == (
        "F0.0 LO0.0 F1.0 LO1.0 WO0.0 F2.0 LO2.0 WO1.0 LL0.0 F3.0 LO3.0 WO2.0 LL1.0 WL0.0 "
        "B0.0 WO3.0 LL2.0 WL1.0 B1.0 LL3.0 WL2.0 B2.0 WL3.0 B3.0"
    )
    assert memory_profile(order) == (
        1, 1, 2, 2, 1, 2, 2, 1, 2, 3, 3, 2, 3, 3, 3, 1, 2, 2, 2, 2, 2, 2, 1, 1
    )  # fmt: skip
    assert memory_profile(order, with_swap=False) == (
        1, 1, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 4, 4, 3, 3, 3, 3, 2, 2, 2, 1, 1
    )  # fmt: skip


def test_composite_holds_both_chunks_while_it_runs() -> None:
    order = (
        MetaStep(K.FWD, 0, 0),
        MetaStep(K.FWD, 0, 1),
        MetaStep(K.OVERLAP_B_F, 0, 0, sub_steps=(MetaStep(K.BWD, 0, 0), MetaStep(K.FWD, 0, 2))),
        MetaStep(K.BWD, 0, 1),
        MetaStep(K.BWD, 0, 2),
    )
    assert memory_profile(order) == (1, 2, 3, 2, 1)


def test_memory_profile_rejects_non_bool() -> None:
    with pytest.raises(TypeError, match="with_swap must be a bool"):
        memory_profile((), with_swap=1)  # type: ignore[arg-type]


def split_one_stage_swapped() -> tuple[ScheduleConfig, Order]:
    """F0..F3 on one stage, then I0 I1 W0 I2 W1 I3 W2 W3 (each W deferred past the next
    I); chunk 3 alone swapped (``min_swap_gap=6``)."""
    config = ScheduleConfig(
        schedule="1f1b", pp=1, micro=4, split_dw=True, swap=True, min_swap_gap=6
    )
    order = (
        *(MetaStep(K.FWD, 0, i) for i in range(4)),
        MetaStep(K.BWD_INPUT, 0, 0),
        MetaStep(K.BWD_INPUT, 0, 1),
        MetaStep(K.BWD_WEIGHT, 0, 0),
        MetaStep(K.BWD_INPUT, 0, 2),
        MetaStep(K.BWD_WEIGHT, 0, 1),
        MetaStep(K.BWD_INPUT, 0, 3),
        MetaStep(K.BWD_WEIGHT, 0, 2),
        MetaStep(K.BWD_WEIGHT, 0, 3),
    )
    return config, inject_swap_steps(order, config, 0)


def test_split_chunk_is_released_where_saved_until_says() -> None:
    _, order = split_one_stage_swapped()
    assert " ".join(s.short() for s in order) == (
        "F0.0 F1.0 F2.0 F3.0 LO3.0 I0.0 WO3.0 I1.0 W0.0 I2.0 LL3.0 W1.0 WL3.0 I3.0 W2.0 W3.0"
    )
    # input: each chunk leaves at its I; chunk 3 (gap 6) is off device from WO3 to LL3
    assert memory_profile(order, saved_until="input") == (
        1, 2, 3, 4, 4, 4, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0
    )  # fmt: skip
    # weight: each chunk stays until its W (chunk 0 through I1, chunk 3 loaded back for
    # I3 through W2 to W3)
    assert memory_profile(order, saved_until="weight") == (
        1, 2, 3, 4, 4, 4, 3, 3, 3, 2, 3, 3, 2, 2, 2, 1
    )  # fmt: skip
    assert memory_profile(order) == memory_profile(order, saved_until="input")
    assert memory_profile(order, with_swap=False, saved_until="weight") == (
        1, 2, 3, 4, 4, 4, 4, 4, 4, 3, 3, 3, 2, 2, 2, 1
    )  # fmt: skip


@pytest.mark.parametrize("saved_until", ["input", "weight"])
@pytest.mark.parametrize(
    "config",
    [
        *NAMED,
        ScheduleConfig(schedule="interleaved_zb", pp=4, vpp=2, micro=8, swap=True),
        ScheduleConfig(schedule="zbv", pp=4, vpp=2, micro=8, swap=True),
        ScheduleConfig(schedule="dualpipev", pp=4, vpp=2, micro=8, swap=True),
    ],
    ids=lambda c: f"{c.schedule}-{c.overlap_b_f}-{c.split_dw}",
)
def test_saved_bytes_profile_in_units_is_the_chunk_profile(
    config: ScheduleConfig, saved_until: str
) -> None:
    ones = [1] * config.num_stages
    for order in build_all_orders(config):
        for with_swap in (False, True):
            assert saved_bytes_profile(
                order, kept=ones, moved=ones, with_swap=with_swap, saved_until=saved_until
            ) == memory_profile(order, with_swap=with_swap, saved_until=saved_until)


def test_release_at_weight_never_predicts_less() -> None:
    """A chunk held to its W is held at least as long: per rank, every peak with
    ``"weight"`` is at least the one with ``"input"``, and on the zero-bubble families
    strictly above it on some rank (their deferred Ws)."""
    for schedule in ("interleaved_zb", "zbv"):
        config = ScheduleConfig(schedule=schedule, pp=4, vpp=2, micro=8, swap=True)
        orders = build_all_orders(config)
        early = memory_rows(orders, saved_until="input")
        late = memory_rows(orders, saved_until="weight")
        assert memory_table(config) == early
        assert memory_table(replace(config, saved_until="weight")) == late
        pairs = [
            (e[key], w[key])
            for e, w in zip(early, late, strict=True)
            for key in ("peak_chunks_no_swap", "peak_chunks_swap")
        ]
        assert all(e <= w for e, w in pairs)
        assert any(e < w for e, w in pairs)


def test_saved_until_and_sizes_are_checked() -> None:
    _, order = split_one_stage_swapped()
    with pytest.raises(ValueError, match="saved_until must be one of input, weight, got 'dw'"):
        memory_profile(order, saved_until="dw")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="saved_until must be one of input, weight"):
        ScheduleConfig(schedule="1f1b", pp=2, micro=2, saved_until="bwd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one int per stage each, got 1 and 2"):
        saved_bytes_profile(order, kept=[4], moved=[1, 1])
    with pytest.raises(ValueError, match="0 <= moved <= kept, got kept=1 and moved=2 for stage 0"):
        saved_bytes_profile(order, kept=[1], moved=[2])
    with pytest.raises(ValueError, match="hold 1 stages; the order runs stage 1"):
        saved_bytes_profile((MetaStep(K.FWD, 1, 0),), kept=[1], moved=[0])


def test_cli_plan_backend_picks_the_release_point(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--schedule", "zbv", "--pp", "4", "--micro", "8", "--swap"]
    peaks = {}
    for backend in (None, "mindspore", "torch"):
        assert main(argv + ([] if backend is None else ["--backend", backend])) == 0
        rows = capsys.readouterr().out.splitlines()[-4:]
        peaks[backend] = [int(row.split("|")[-1]) for row in rows]
    config = ScheduleConfig(schedule="zbv", pp=4, vpp=2, micro=8, swap=True)
    assert (
        peaks[None] == peaks["mindspore"] == [r["peak_chunks_swap"] for r in memory_table(config)]
    )
    torch_rows = memory_table(replace(config, saved_until="weight"))
    assert peaks["torch"] == [r["peak_chunks_swap"] for r in torch_rows] == [2, 4, 6, 7]
    with pytest.raises(SystemExit):
        main([*argv, "--backend", "jax"])
    assert "--backend: invalid choice: 'jax'" in capsys.readouterr().err


def test_gpipe_pp4_m8_memory_table() -> None:
    # Without swap GPipe holds all 8 forwards before the first backward: peak 8 everywhere.
    # With swap every chunk has gap >= 8: each is freed after one intervening compute
    # (WAIT_OFFLOAD before FWD i+2), so the forward phase holds 2 chunks; the peak, 3,
    # comes at the phase change: F7 runs with chunk 6 (offload not yet waited), chunk 7
    # and chunk 0 (loaded before F7 to be ready for B0), and from B0 on each BWD holds
    # its own chunk, the next one being loaded and at most one leftover.
    assert memory_table(GPIPE) == [
        {"rank": r, "peak_chunks_no_swap": 8, "peak_chunks_swap": 3, "eligible": 8}
        for r in range(4)
    ]


def test_1f1b_pp4_m8_memory_table() -> None:
    # No swap: rank r peaks at warm-up + 1 = pp - r chunks. Rank 0 (all 8 gaps >= 4):
    # during F3 chunk 1 is already on the host and chunk 0 is loaded back for B0: 3.
    # Rank 1 peaks during F2 with chunk 0 (gap 3, not eligible), chunk 1 (its offload is
    # waited after F2) and chunk 2: swap cannot lower it. Ranks 2, 3: every gap < 4.
    rows = [
        (r["peak_chunks_no_swap"], r["peak_chunks_swap"], r["eligible"])
        for r in memory_table(ONE_F_ONE_B)
    ]
    assert rows == [(4, 3, 8), (3, 3, 6), (2, 2, 0), (1, 1, 0)]


def test_interleaved_pp4_vpp2_m8_memory_table() -> None:
    # No swap: warm-up (pp - r - 1) * 2 + (vpp - 1) * pp forwards plus one: 11, 9, 7, 5.
    rows = [
        (r["peak_chunks_no_swap"], r["peak_chunks_swap"], r["eligible"])
        for r in memory_table(INTERLEAVED)
    ]
    assert rows == [(11, 3, 16), (9, 3, 16), (7, 3, 14), (5, 2, 8)]


def test_memory_table_forces_swap_and_refuses_forward_only() -> None:
    no_swap = ScheduleConfig(schedule="gpipe", pp=4, micro=8)
    assert memory_table(no_swap) == memory_table(GPIPE)
    with pytest.raises(ValueError, match="swap must be False for a forward-only run"):
        memory_table(ScheduleConfig(schedule="gpipe", pp=2, micro=2, forward_only=True))
    with pytest.raises(TypeError, match="config must be a ScheduleConfig"):
        memory_table("gpipe")  # type: ignore[arg-type]


@pytest.mark.parametrize("config", NAMED, ids=lambda c: f"{c.schedule}-{c.overlap_b_f}")
def test_swap_never_raises_the_peak(config: ScheduleConfig) -> None:
    for row in memory_table(config):
        assert row["peak_chunks_swap"] <= row["peak_chunks_no_swap"]
        if row["eligible"] == 0:
            assert row["peak_chunks_swap"] == row["peak_chunks_no_swap"]


# -- columns of every step, copy windows, memory over columns -----------------------------


def test_copy_windows_by_hand() -> None:
    config, order = gpipe_one_stage_swapped()
    timeline = build_timeline(config, (order,))
    assert [c.column for c in timeline.cells[0]] == list(range(8))
    windows = copy_windows(timeline, 0, order)
    offload = [(w.micro, w.start, w.end) for w in windows if w.kind == "offload"]
    load = [(w.micro, w.start, w.end) for w in windows if w.kind == "load"]
    # offload from the end of F_i to the end of the next compute slot
    assert offload == [(0, 1, 2), (1, 2, 3), (2, 3, 4), (3, 4, 5)]
    # load launched after slot c-2 ends, waited when slot c-1 ends
    assert load == [(0, 3, 4), (1, 4, 5), (2, 5, 6), (3, 6, 7)]
    assert windows[0] == CopyWindow("offload", 0, 0, 1, 2)


@pytest.mark.parametrize("config", NAMED, ids=lambda c: f"{c.schedule}-{c.overlap_b_f}")
def test_step_columns_and_resident_by_column(config: ScheduleConfig) -> None:
    orders = build_all_orders(config)
    timeline = build_timeline(config, orders)
    for rank, order in enumerate(orders):
        columns = step_columns(timeline, rank, order)
        assert list(columns) == sorted(columns)
        for cell in timeline.cells[rank]:
            assert columns[cell.index] == cell.column
        for with_swap in (True, False):
            per_column = resident_by_column(timeline, rank, order, with_swap=with_swap)
            assert len(per_column) == timeline.num_columns
            assert max(per_column) == max(memory_profile(order, with_swap=with_swap))
        for window in copy_windows(timeline, rank, order):
            assert 0 <= window.start <= window.end < timeline.num_columns


def test_step_columns_rejects_a_foreign_order() -> None:
    orders = build_all_orders(GPIPE)
    timeline = build_timeline(GPIPE, orders)
    with pytest.raises(ValueError, match="does not match the timeline of rank 0"):
        step_columns(timeline, 0, orders[0][:3])


@pytest.mark.parametrize("micro", [4, 6, 16])
def test_gpipe_swap_peak_is_constant_in_micro(micro: int) -> None:
    # docs/memory-model.md: swap turns GPipe's O(m) activation peak into 3 chunks.
    for p2p in ("plain", "batch"):
        config = ScheduleConfig(schedule="gpipe", pp=4, micro=micro, p2p=p2p, swap=True)
        rows = memory_table(config)
        assert {(r["peak_chunks_no_swap"], r["peak_chunks_swap"]) for r in rows} == {(micro, 3)}
