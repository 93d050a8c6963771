"""Text rendering of per-rank orders: one row per rank, one cell per top-level step.

Cells use ``MetaStep.short()`` (``F3.0`` is FWD of micro 3 on stage 0, ``UN.s2`` an
FSDP_UNSHARD of stage 2, ``BATCH[SF0.0+RB1.0]`` a fused P2P container). Used by the
``ppswap plan`` CLI and by the deadlock message of the cross-rank simulation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ppswap.scheduler.steps import Order

__all__ = ["MARK", "format_grid"]

MARK = ">>"
"""Prefix of a marked cell (for instance where a rank is stuck)."""

_ELLIPSIS = "..."


def _cells(order: Order, mark: int | None, window: int | None) -> list[str]:
    """The cells of one row."""
    first = 0
    last = len(order)
    if window is not None and mark is not None:
        first = max(0, mark - window)
        last = min(len(order), mark + window + 1)
    cells = [
        (MARK + step.short()) if index == mark else step.short()
        for index, step in enumerate(order[first:last], start=first)
    ]
    if mark is not None and mark >= len(order):
        cells.append(MARK + "(end)")
    if first > 0:
        cells.insert(0, _ELLIPSIS)
    if last < len(order):
        cells.append(_ELLIPSIS)
    return cells


def format_grid(
    orders: Sequence[Order],
    *,
    compact: bool = True,
    marks: Mapping[int, int] | None = None,
    window: int | None = None,
) -> str:
    """Render ``orders`` (indexed by rank) as a text grid, one line per rank.

    ``compact=True``: each row lists its steps separated by one space.
    ``compact=False``: cells are padded so that step ``k`` of every rank lines up in
    column ``k`` under a header of step indices (a column is a position in the order,
    not a time).
    ``marks`` maps a rank to a step index to highlight with ``>>`` (an index equal to
    the order's length marks the end). With ``window`` and a mark, a row shows only the
    steps within ``window`` of its mark, ``...`` standing for the rest, and the rows
    are laid out compactly (windows of different ranks do not line up).
    """
    if window is not None and (not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None or an int >= 0, got {window!r}")
    marks = marks or {}
    label_width = len(f"rank {max(len(orders) - 1, 0)}")
    rows: list[tuple[str, list[str]]] = []
    for rank, order in enumerate(orders):
        cells = _cells(order, marks.get(rank), window)
        rows.append((f"rank {rank}".ljust(label_width), cells))
    if compact or window is not None:
        return "\n".join(f"{label} | {' '.join(cells)}".rstrip() for label, cells in rows)
    columns = max((len(cells) for _, cells in rows), default=0)
    widths = [0] * columns
    for _, cells in rows:
        for column, cell in enumerate(cells):
            widths[column] = max(widths[column], len(cell))
    header_cells = [str(column).ljust(widths[column]) for column in range(columns)]
    for column, cell in enumerate(header_cells):
        widths[column] = max(widths[column], len(cell))
    lines = [f"{'step'.ljust(label_width)} | {' '.join(header_cells)}".rstrip()]
    for label, cells in rows:
        padded = [cell.ljust(widths[column]) for column, cell in enumerate(cells)]
        lines.append(f"{label} | {' '.join(padded)}".rstrip())
    return "\n".join(lines)
