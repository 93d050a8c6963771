"""The schedule diagram: per-rank lanes on the global logical time axis.

Only the CLI's ``plot`` command imports this module (matplotlib is an optional extra,
``ppswap[plot]``); ``ppswap.scheduler`` itself never imports it.

What is drawn, for the orders lowered from the config (with ``config.swap`` or without):

- top panel, one lane per rank: each compute slot as a cell in its column (see
  ``simulate.build_timeline``): ``C·F`` a FWD that collects an eligible chunk, ``W·B`` /
  ``W·dx`` a BWD / BWD_INPUT preceded by its SWAP_WAIT_LOAD, ``R·B`` / ``R·dx`` one
  preceded by its chunk's RECOMPUTE (``R·W·B`` both), plain ``F``, ``B``, ``dx``,
  ``dw`` otherwise, the micro-batch under it (``3v1``: micro 3 of the rank's virtual stage
  1; later virtual stages are drawn darker). A composite (OVERLAP_B_F / OVERLAP_F_B) is
  one split cell, its two leaves one above the other. With swap, under each lane two thin
  rows: the offload windows (SWAP_LAUNCH_OFFLOAD to SWAP_WAIT_OFFLOAD) and the load windows
  (SWAP_LAUNCH_LOAD to SWAP_WAIT_LOAD) of ``simulate.copy_windows``, labelled with their
  micro-batch; windows that overlap in time are stacked on separate tracks, and a launch
  directly followed by its wait is a short tick. Both rows share ONE copy stream at run
  time; they are split only to be readable. Columns where a rank runs no compute
  (bubbles) are hatched grey. P2P and FSDP steps are not drawn.
- bottom panel: resident activation chunks per rank over the same columns; with swap
  (solid) against the same order without swap (dashed), or without swap alone (solid).

A column is a logical compute slot, not measured time; the windows are the static
launch-to-wait windows of the plan.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from ppswap.scheduler.config import SavedUntil, ScheduleConfig
from ppswap.scheduler.cost import CostModel, SwapPolicy, build_orders
from ppswap.scheduler.simulate import (
    CopyWindow,
    Timeline,
    build_timeline,
    copy_windows,
    resident_by_column,
)
from ppswap.scheduler.steps import (
    COMPUTE_KINDS,
    CONSUMER_KINDS,
    MetaStep,
    Order,
    StepKind,
    iter_leaves,
)
from ppswap.scheduler.swap_plan import eligible_chunks

__all__ = ["PLOT_SUFFIXES", "cell_label", "pack_windows", "plot_schedule", "schedule_figure"]

PLOT_SUFFIXES = (".png", ".svg")

_LANE = 1.0  # height of a compute lane
_TRACK = 0.2  # height of one track of an offload / load row
_SPACING = 0.4  # space between the rows of one rank and the next lane

_LEAF_COLORS: dict[StepKind, tuple[str, str]] = {
    # (first virtual stage, later virtual stages)
    StepKind.FWD: ("#8ec5ff", "#5b9be0"),
    StepKind.BWD: ("#9ee09e", "#5dbb6a"),
    StepKind.BWD_INPUT: ("#ffd08a", "#eaa651"),
    StepKind.BWD_WEIGHT: ("#ddc9f2", "#b295d6"),
}
_PLAIN: dict[StepKind, str] = {
    StepKind.FWD: "F",
    StepKind.BWD: "B",
    StepKind.BWD_INPUT: "dx",
    StepKind.BWD_WEIGHT: "dw",
}
_OFFLOAD_COLOR = "#d9534f"
_LOAD_COLOR = "#1f8a7e"
_BUBBLE_FACE = "#ececec"
_BUBBLE_EDGE = "#a0a0a0"
_RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2")


def cell_label(
    leaf: MetaStep,
    eligible: frozenset[tuple[int, int]],
    recomputed: frozenset[tuple[int, int]] = frozenset(),
) -> str:
    """The kind label of a compute leaf: ``C·F``, ``W·B``, ``W·dx`` for the swap life
    cycle of an eligible chunk, ``R·B``, ``R·dx`` for the backward of a recomputed chunk
    (``R·W·B``: both), ``F``, ``B``, ``dx``, ``dw`` otherwise."""
    if leaf.kind not in COMPUTE_KINDS:
        raise ValueError(f"leaf must be a compute leaf, got {leaf.kind.value}")
    plain = _PLAIN[leaf.kind]
    if leaf.chunk in eligible and leaf.kind is StepKind.FWD:
        return "C·F"
    if leaf.kind in CONSUMER_KINDS:
        prefix = ("R·" if leaf.chunk in recomputed else "") + (
            "W·" if leaf.chunk in eligible else ""
        )
        return f"{prefix}{plain}"
    return plain


def pack_windows(windows: Sequence[CopyWindow]) -> tuple[int, ...]:
    """Greedy track assignment: windows that overlap in time get different tracks.

    Windows are taken in the given order; each goes to the lowest track whose last window
    ended at or before its start (a zero-length window occupies a sliver of its column).
    """
    track_end: list[float] = []
    tracks: list[int] = []
    for window in windows:
        start = float(window.start)
        end = max(float(window.end), start + 0.25)
        for track, busy_until in enumerate(track_end):
            if busy_until <= start:
                track_end[track] = end
                tracks.append(track)
                break
        else:
            track_end.append(end)
            tracks.append(len(track_end) - 1)
    return tuple(tracks)


@dataclass(frozen=True, slots=True)
class _Layout:
    """Vertical layout shared by all ranks (same row heights for every lane); no offload
    or load rows at all (0 tracks) without swap."""

    offload_tracks: int
    load_tracks: int

    @property
    def pitch(self) -> float:
        return _LANE + (self.offload_tracks + self.load_tracks) * _TRACK + _SPACING

    def lane_bottom(self, rank: int) -> float:
        return -rank * self.pitch - _LANE

    def row_bottom(self, rank: int, kind: str) -> float:
        offload_bottom = self.lane_bottom(rank) - self.offload_tracks * _TRACK
        if kind == "offload":
            return offload_bottom
        return offload_bottom - self.load_tracks * _TRACK


def _micro_label(stage: int, micro: int, config: ScheduleConfig) -> str:
    if config.vpp == 1:
        return str(micro)
    return f"{micro}v{stage // config.pp}"


def _draw_leaf(
    ax: Axes,
    leaf: MetaStep,
    origin: tuple[float, float],
    height: float,
    config: ScheduleConfig,
    eligible: frozenset[tuple[int, int]],
    recomputed: frozenset[tuple[int, int]],
) -> None:
    x, y = origin
    shades = _LEAF_COLORS[leaf.kind]
    color = shades[0] if leaf.stage < config.pp else shades[1]
    ax.add_patch(Rectangle((x, y), 1.0, height, facecolor=color, edgecolor="#333333", lw=0.6))
    label = cell_label(leaf, eligible, recomputed)
    micro = _micro_label(leaf.stage, leaf.micro, config)
    split = height < _LANE
    ax.text(
        x + 0.5,
        y + height / 2,
        f"{label}{micro}" if split else f"{label}\n{micro}",
        ha="center",
        va="center",
        fontsize=5.2 if split else 7,
        fontweight="bold" if "·" in label else "normal",
    )


def _draw_rank(
    ax: Axes,
    config: ScheduleConfig,
    timeline: Timeline,
    layout: _Layout,
    rank: int,
    order: Order,
) -> None:
    eligible = eligible_chunks(order)
    recomputed = frozenset(step.chunk for step in order if step.kind is StepKind.RECOMPUTE)
    lane_y = layout.lane_bottom(rank)
    busy = timeline.busy_columns(rank)
    for column in range(timeline.num_columns):
        if column not in busy:
            ax.add_patch(
                Rectangle(
                    (column, lane_y),
                    1,
                    _LANE,
                    facecolor=_BUBBLE_FACE,
                    edgecolor=_BUBBLE_EDGE,
                    hatch="////",
                    lw=0.4,
                )
            )
    for cell in timeline.cells[rank]:
        leaves = [leaf for leaf in iter_leaves((cell.step,)) if leaf.kind in COMPUTE_KINDS]
        height = _LANE / len(leaves)
        for position, leaf in enumerate(leaves):
            y = lane_y + _LANE - (position + 1) * height
            _draw_leaf(ax, leaf, (float(cell.column), y), height, config, eligible, recomputed)
    windows = copy_windows(timeline, rank, order)
    for kind, color, tracks in (
        ("offload", _OFFLOAD_COLOR, layout.offload_tracks),
        ("load", _LOAD_COLOR, layout.load_tracks),
    ):
        if tracks == 0:
            continue
        chosen = [w for w in windows if w.kind == kind]
        bottom = layout.row_bottom(rank, kind)
        for window, track in zip(chosen, pack_windows(chosen), strict=True):
            y = bottom + (tracks - 1 - track) * _TRACK
            width = window.end - window.start
            if width == 0:
                box = (window.start - 0.07, y + 0.02, 0.14, _TRACK - 0.04)
            else:
                box = (window.start + 0.04, y + 0.02, width - 0.08, _TRACK - 0.04)
            ax.add_patch(Rectangle(box[:2], box[2], box[3], facecolor=color, edgecolor="none"))
            if width > 0:
                ax.text(
                    window.start + width / 2,
                    y + _TRACK / 2,
                    _micro_label(window.stage, window.micro, config),
                    ha="center",
                    va="center",
                    fontsize=4.8,
                    color="white",
                )
        label_y = bottom + tracks * _TRACK / 2
        ax.text(-0.3, label_y, kind, ha="right", va="center", fontsize=6, color=color)
    ax.text(-0.3, lane_y + _LANE / 2, f"rank {rank}", ha="right", va="center", fontsize=9)


def _draw_memory(
    ax: Axes,
    timeline: Timeline,
    orders: Sequence[Order],
    columns: int,
    swap: bool,
    saved_until: SavedUntil,
) -> None:
    """Resident chunks per rank: with ``swap``, swap (solid) against no swap (dashed);
    without, the no-swap line alone (solid); a split chunk held until ``saved_until``."""
    xs = list(range(columns + 1))
    styles = ((False, "--"), (True, "-")) if swap else ((False, "-"),)
    for rank, order in enumerate(orders):
        color = _RANK_COLORS[rank % len(_RANK_COLORS)]
        for with_swap, style in styles:
            values = list(
                resident_by_column(
                    timeline, rank, order, with_swap=with_swap, saved_until=saved_until
                )
            )
            values += [values[-1] if values else 0] * (columns + 1 - len(values))
            ax.step(xs, values, where="post", color=color, linestyle=style, lw=1.3)
    ax.set_ylabel("resident chunks")
    ax.set_xlabel("logical compute slot (column)")
    ax.grid(axis="y", color="#dddddd", lw=0.5)
    ax.set_ylim(bottom=0)
    handles = [
        Line2D([], [], color=_RANK_COLORS[r % len(_RANK_COLORS)], lw=2, label=f"rank {r}")
        for r in range(len(orders))
    ]
    if swap:
        handles += [
            Line2D([], [], color="black", lw=1.3, label="swap"),
            Line2D([], [], color="black", lw=1.3, linestyle="--", label="no swap"),
        ]
    else:
        handles.append(Line2D([], [], color="black", lw=1.3, label="no swap"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))


def _title(config: ScheduleConfig) -> str:
    parts = [config.schedule, f"pp={config.pp}"]
    if config.vpp > 1:
        parts.append(f"vpp={config.vpp}")
    parts.append(f"m={config.micro}")
    for name, on in (
        ("overlap_b_f", config.overlap_b_f),
        ("dx/dw split", config.split_dw),
        ("fsdp", config.fsdp),
    ):
        if on:
            parts.append(name)
    parts.append(f"p2p={config.p2p}")
    parts.append(f"swap (min gap {config.min_swap_gap})" if config.swap else "no swap")
    return "   ".join(parts)


def _tracks(windows: Sequence[Sequence[CopyWindow]], kind: str) -> int:
    """The tracks the busiest rank needs for its ``kind`` windows (at least one)."""
    return max(
        [1]
        + [max(pack_windows([w for w in ws if w.kind == kind]), default=0) + 1 for ws in windows]
    )


def _layout(config: ScheduleConfig, windows: Sequence[Sequence[CopyWindow]]) -> _Layout:
    """Enough offload and load tracks for the busiest rank; none without swap."""
    if not config.swap:
        return _Layout(offload_tracks=0, load_tracks=0)
    return _Layout(offload_tracks=_tracks(windows, "offload"), load_tracks=_tracks(windows, "load"))


def _legend_handles(config: ScheduleConfig) -> list[Patch]:
    """The schedule panel's legend: bubbles, and the swap marks only with swap."""
    bubble = Patch(facecolor=_BUBBLE_FACE, edgecolor=_BUBBLE_EDGE, hatch="////", label="bubble")
    if not config.swap:
        return [bubble]
    return [
        Patch(facecolor=_OFFLOAD_COLOR, label="offload window (LAUNCH → WAIT)"),
        Patch(facecolor=_LOAD_COLOR, label="load window (LAUNCH → WAIT)"),
        bubble,
        Patch(facecolor="none", edgecolor="none", label="C·F: collect   W·B/W·dx: wait load"),
    ]


def schedule_figure(
    config: ScheduleConfig,
    *,
    swap_policy: SwapPolicy = "gap",
    cost_model: CostModel | None = None,
) -> Figure:
    """The schedule diagram of ``config`` as a matplotlib Figure (not saved); with swap,
    the chunks ``swap_policy`` moves (``cost.build_orders``).

    The orders are lowered as ``config`` says: with ``config.swap`` the diagram shows the
    swap steps' effects (C·F / W·B cells, offload and load windows) and its memory panel
    compares the orders with and without swap; without, it shows no swap at all (plain
    cells, no window rows, the no-swap memory line alone).
    """
    if not isinstance(config, ScheduleConfig):
        raise TypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    orders = build_orders(config, swap_policy, cost_model)
    timeline = build_timeline(config, orders)
    windows = [copy_windows(timeline, rank, order) for rank, order in enumerate(orders)]
    layout = _layout(config, windows)
    columns = max(timeline.num_columns, 1)
    lanes_height = config.pp * layout.pitch
    figure = Figure(figsize=(max(9.0, 0.42 * columns + 2.6), 1.05 * lanes_height + 3.6))
    schedule_ax, memory_ax = figure.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [lanes_height, 2.4]}
    )
    for rank, order in enumerate(orders):
        _draw_rank(schedule_ax, config, timeline, layout, rank, order)
    schedule_ax.set_xlim(-0.1, columns + 0.1)
    schedule_ax.set_ylim(layout.row_bottom(config.pp - 1, "load") - 0.1, 0.1)
    schedule_ax.set_yticks([])
    for side in ("left", "right", "top"):
        schedule_ax.spines[side].set_visible(False)
    schedule_ax.set_title(_title(config), fontsize=10, pad=22)
    handles = _legend_handles(config)
    schedule_ax.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(handles),
        fontsize=7,
        frameon=False,
    )
    _draw_memory(memory_ax, timeline, orders, columns, config.swap, config.saved_until)
    memory_ax.set_xticks(range(0, columns + 1, 2 if columns > 30 else 1))
    memory_ax.tick_params(axis="x", labelsize=7)
    figure.tight_layout()
    return figure


def plot_schedule(
    config: ScheduleConfig,
    path: str | os.PathLike[str],
    *,
    swap_policy: SwapPolicy = "gap",
    cost_model: CostModel | None = None,
) -> Path:
    """Draw the schedule diagram of ``config`` (``schedule_figure``) to ``path`` (``.png``
    or ``.svg``): with swap (the chunks of ``swap_policy``) when ``config.swap`` is set,
    without otherwise.

    Creates missing parent folders; returns the path written. Raises TypeError for a
    config that is not a ScheduleConfig and ValueError for another suffix (both before
    anything is built).
    """
    if not isinstance(config, ScheduleConfig):
        raise TypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    target = Path(path)
    if target.suffix.lower() not in PLOT_SUFFIXES:
        raise ValueError(
            f"path must end in {' or '.join(PLOT_SUFFIXES)}, got {str(path)!r} "
            f"(suffix {target.suffix!r})"
        )
    figure = schedule_figure(config, swap_policy=swap_policy, cost_model=cost_model)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=130)
    return target
