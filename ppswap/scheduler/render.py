"""Text rendering of per-rank orders: one row per rank, one cell per top-level step.

Cells use ``MetaStep.short()`` (``F3.0`` is FWD of micro 3 on stage 0, ``UN.s2`` an
FSDP_UNSHARD of stage 2, ``BATCH[SF0.0+RB1.0]`` a fused P2P container); ``step_legend``
explains, in words, every code that appears in a set of orders. Used by the ``ppswap plan``
CLI and by the deadlock message of the cross-rank simulation.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Iterator, Mapping, Sequence

from ppswap.scheduler.steps import SWAP_KINDS, MetaStep, Order, StepKind

__all__ = ["MARK", "STEP_DESCRIPTIONS", "format_grid", "step_legend"]

MARK = ">>"
"""Prefix of a marked cell (for instance where a rank is stuck)."""

_ELLIPSIS = "..."

STEP_DESCRIPTIONS: Mapping[StepKind, str] = {
    StepKind.FWD: "forward",
    StepKind.BWD: "backward (input and weight gradients together)",
    StepKind.BWD_INPUT: "backward, input gradient only (dx of the dx/dw split)",
    StepKind.BWD_WEIGHT: "backward, weight gradient only (dw of the dx/dw split)",
    StepKind.SEND_F: "send the forward output to the next stage's rank",
    StepKind.RECV_F: "receive the forward input from the previous stage's rank",
    StepKind.SEND_B: "send the input gradient to the previous stage's rank",
    StepKind.RECV_B: "receive the output gradient from the next stage's rank",
    StepKind.BATCH_SEND_RECV: "the P2P steps in [...] issued together as one batch",
    StepKind.OVERLAP_B_F: "a backward and a forward run overlapped as one slot [B+F]",
    StepKind.OVERLAP_F_B: "a forward and a backward run overlapped as one slot [F+B]",
    StepKind.FSDP_UNSHARD: "FSDP: gather the parameters of stage N (cell .sN)",
    StepKind.FSDP_RESHARD: "FSDP: drop the gathered parameters of stage N, keep its shard",
    StepKind.SWAP_LAUNCH_OFFLOAD: "swap: start copying the chunk's activations to host",
    StepKind.SWAP_WAIT_OFFLOAD: "swap: wait for that copy, then free the chunk's device memory",
    StepKind.SWAP_LAUNCH_LOAD: "swap: start copying the chunk's activations back to device",
    StepKind.SWAP_WAIT_LOAD: "swap: wait for that copy (the chunk's backward needs it)",
    StepKind.TIED_GRAD_SUM: "sum a tied parameter's gradients over the stages holding it",
    StepKind.RECOMPUTE: "recompute: run the chunk's recompute-wrapped blocks again (its backward)",
}
"""What each step kind does, in words (the legend of ``ppswap plan``'s grid)."""

_CODE = re.compile(r"[A-Z]+")
_LEGEND_HEAD = (
    "legend: a cell CODE<m>.<s> is a step of micro-batch m on stage s (stage s runs on rank",
    "s % pp; zbv and dualpipev fold it back in a V: rank 2*pp-1-s for s >= pp), e.g. F3.0",
    "is the forward of micro-batch 3 on stage 0.",
)
_LEGEND_CHUNK = "A chunk is what one forward of one stage saves for its backward."


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


def _column_blocks(label_width: int, widths: Sequence[int], width: int | None) -> list[range]:
    """Consecutive column ranges whose aligned lines fit in ``width`` characters.

    A line is ``label | cell cell ...``: ``label_width + 2`` characters plus ``1 + w`` per
    column ``w`` characters wide. A column too wide to fit even alone gets a block of its
    own. ``width=None``: one block holding every column.
    """
    if width is None:
        return [range(len(widths))]
    blocks: list[range] = []
    start = 0
    used = label_width + 2
    for column, cell_width in enumerate(widths):
        if column > start and used + 1 + cell_width > width:
            blocks.append(range(start, column))
            start, used = column, label_width + 2
        used += 1 + cell_width
    blocks.append(range(start, len(widths)))
    return blocks


def _block_range(block: range) -> str:
    """``steps 3-9``, or ``step 3`` for a block of one column."""
    if len(block) == 1:
        return f"step {block.start}"
    return f"steps {block.start}-{block.stop - 1}"


def _aligned_lines(
    rows: Sequence[tuple[str, list[str]]], label_width: int, width: int | None
) -> list[str]:
    """A header of step indices, then one line per rank, cells padded so that step ``k``
    of every rank lines up; folded into column blocks when wider than ``width``, each
    block after a ``steps A-B of N:`` line and blocks separated by a blank line."""
    columns = max((len(cells) for _, cells in rows), default=0)
    widths = [len(str(column)) for column in range(columns)]
    for _, cells in rows:
        for column, cell in enumerate(cells):
            widths[column] = max(widths[column], len(cell))
    blocks = _column_blocks(label_width, widths, width)
    lines: list[str] = []
    for block in blocks:
        if len(blocks) > 1:
            if lines:
                lines.append("")
            lines.append(f"{_block_range(block)} of {columns}:")
        header = [str(column).ljust(widths[column]) for column in block]
        lines.append(f"{'step'.ljust(label_width)} | {' '.join(header)}".rstrip())
        for label, cells in rows:
            padded = [
                cells[column].ljust(widths[column]) for column in block if column < len(cells)
            ]
            lines.append(f"{label} | {' '.join(padded)}".rstrip())
    return lines


def format_grid(
    orders: Sequence[Order],
    *,
    compact: bool = True,
    marks: Mapping[int, int] | None = None,
    window: int | None = None,
    width: int | None = None,
) -> str:
    """Render ``orders`` (indexed by rank) as a text grid, one line per rank.

    ``compact=True``: each row lists its steps separated by one space.
    ``compact=False``: cells are padded so that step ``k`` of every rank lines up in
    column ``k`` under a header of step indices (a column is a position in the order,
    not a time). With ``width``, an aligned grid wider than ``width`` characters is
    folded into blocks of consecutive columns, each headed ``steps A-B of N:`` and
    separated by a blank line, so that no line is longer than ``width`` (unless a single
    cell is); every step is still shown. ``width`` does not change the compact or
    windowed layouts.
    ``marks`` maps a rank to a step index to highlight with ``>>`` (an index equal to
    the order's length marks the end). With ``window`` and a mark, a row shows only the
    steps within ``window`` of its mark, ``...`` standing for the rest, and the rows
    are laid out compactly (windows of different ranks do not line up).
    """
    if window is not None and (not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None or an int >= 0, got {window!r}")
    if width is not None and (not isinstance(width, int) or isinstance(width, bool) or width < 1):
        raise ValueError(f"width must be None or an int >= 1, got {width!r}")
    marks = marks or {}
    label_width = len(f"rank {max(len(orders) - 1, 0)}")
    rows: list[tuple[str, list[str]]] = []
    for rank, order in enumerate(orders):
        cells = _cells(order, marks.get(rank), window)
        rows.append((f"rank {rank}".ljust(label_width), cells))
    if compact or window is not None:
        return "\n".join(f"{label} | {' '.join(cells)}".rstrip() for label, cells in rows)
    return "\n".join(_aligned_lines(rows, label_width, width))


def _walk(steps: Sequence[MetaStep]) -> Iterator[MetaStep]:
    """Every step, containers and composites first, then their sub-steps (depth first)."""
    for step in steps:
        yield step
        yield from _walk(step.sub_steps)


def _code(step: MetaStep) -> str:
    """The code that ``step.short()`` starts with (``SF`` of ``SF3.0``, ``UN`` of ``UN.s2``)."""
    found = _CODE.match(step.short())
    return found.group() if found else step.kind.value


def step_legend(orders: Sequence[Order], *, width: int = 100) -> str:
    """The legend of the grid of ``orders``: a line on how to read a cell, then one entry
    per step kind that appears (at any depth), in ``StepKind`` order: its code as
    ``MetaStep.short()`` writes it, the kind's name and what it does
    (``STEP_DESCRIPTIONS``). Lines are wrapped at ``width`` characters (>= 40)."""
    if not isinstance(width, int) or isinstance(width, bool) or width < 40:
        raise ValueError(f"width must be an int >= 40, got {width!r}")
    codes = {step.kind: _code(step) for order in orders for step in _walk(order)}
    kinds = [kind for kind in StepKind if kind in codes]
    code_width = max((len(codes[kind]) for kind in kinds), default=0)
    name_width = max((len(kind.value) for kind in kinds), default=0)
    head = [*_LEGEND_HEAD, _LEGEND_CHUNK] if SWAP_KINDS.intersection(kinds) else _LEGEND_HEAD
    lines = [part for sentence in head for part in textwrap.wrap(sentence, width)]
    for kind in kinds:
        lead = f"  {codes[kind]:<{code_width}}  {kind.value:<{name_width}}  "
        text = STEP_DESCRIPTIONS.get(kind, kind.value)
        lines += textwrap.wrap(lead + text, width, subsequent_indent=" " * len(lead))
    return "\n".join(lines)
