"""Global logical timeline, bubbles and the resident-chunk memory model.

Timeline
    Every compute slot (a top-level compute leaf or a composite, see
    ``analysis.compute_slots``) of every rank gets a global *column*: the earliest logical
    time its data dependencies allow, one compute slot per column per rank, each rank
    running its slots in its own order. The dependencies between compute leaves are the
    dependency rule of ``ppswap.scheduler.analysis`` (FWD after the previous stage's FWD,
    a backward after the next stage's backward or, on the last stage, its own FWD,
    BWD_WEIGHT after its BWD_INPUT); a composite depends on what both its leaves depend on.
    ``column = max(previous slot of the rank + 1, every dependency's column + 1)``. A
    column is a logical compute slot, not wall-clock time. A *bubble* is a column in
    ``0 .. num_columns - 1`` where a rank runs no compute.

Memory model (unit: one activation chunk ``(stage, micro)``)
    Walking one rank's order: +1 when a FWD runs; with swap, -1 at SWAP_WAIT_OFFLOAD (the
    device storage is released) and +1 at SWAP_LAUNCH_LOAD (it is allocated again); -1
    when the chunk's *release* completes: its BWD, or, with the dx/dw split, its
    BWD_INPUT where ``saved_until="input"`` (MindSpore: dx and dw are computed there) and
    its BWD_WEIGHT where ``saved_until="weight"`` (torch: the weight pass reads the
    graph's saved tensors, so a swapped chunk loaded back for its BWD_INPUT stays on device
    until its BWD_WEIGHT). The profile gives one value per top-level step: for a compute
    slot the chunks resident *while it runs* (the chunk its FWD produces counts from its
    start, the chunk it releases until it completes, so an OVERLAP_B_F slot holds both),
    for any other step the chunks resident right after it. The peak is the maximum of the
    profile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ppswap.scheduler.analysis import (
    check_orders,
    compute_slots,
    slot_dependencies,
)
from ppswap.scheduler.checks import check_one_of
from ppswap.scheduler.config import SAVED_UNTIL, SavedUntil, ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.steps import (
    BWD,
    BWD_INPUT,
    BWD_WEIGHT,
    COMPUTE_KINDS,
    FWD,
    LAUNCH_OF_WAIT,
    SWAP_LAUNCH_KINDS,
    SWAP_LAUNCH_LOAD,
    SWAP_LAUNCH_OFFLOAD,
    SWAP_WAIT_OFFLOAD,
    MetaStep,
    Order,
    StepKind,
    iter_leaves,
)
from ppswap.scheduler.swap_plan import eligible_chunks
from ppswap.scheduler.validate import ScheduleDeadlockError

__all__ = [
    "CopyWindow",
    "Timeline",
    "TimelineCell",
    "build_timeline",
    "copy_windows",
    "memory_profile",
    "memory_rows",
    "memory_table",
    "releases_chunk",
    "resident_by_column",
    "saved_bytes_profile",
    "split_release_kind",
    "step_columns",
]


@dataclass(frozen=True, slots=True)
class TimelineCell:
    """One compute slot placed on the global timeline.

    ``slot`` is the rank-local compute-slot number, ``index`` the step's top-level index in
    the rank's order, ``column`` its global logical time.
    """

    rank: int
    slot: int
    index: int
    column: int
    step: MetaStep


@dataclass(frozen=True, slots=True)
class Timeline:
    """All ranks' compute slots on one logical time axis.

    ``cells[r]`` lists rank ``r``'s cells in slot order; ``bubbles[r]`` counts the columns
    in ``0 .. num_columns - 1`` where rank ``r`` runs no compute.
    """

    num_columns: int
    cells: tuple[tuple[TimelineCell, ...], ...]
    bubbles: tuple[int, ...]

    def busy_columns(self, rank: int) -> frozenset[int]:
        """The columns where ``rank`` runs a compute slot."""
        return frozenset(cell.column for cell in self.cells[rank])


def build_timeline(config: ScheduleConfig, orders: Sequence[Order]) -> Timeline:
    """Place every rank's compute slots on the global logical timeline.

    ``orders[r]`` is rank ``r``'s order (compute-only, lowered, with or without swap
    steps). Raises ValueError when a leaf depends on a step no rank runs, and
    ``validate.ScheduleDeadlockError`` (a ValueError) when the ranks cannot all finish
    (their compute slots wait on each other in a cycle); its ``stuck`` maps each stuck rank
    to the top-level index of the slot it cannot run.
    """
    check_orders(config, orders)
    slots = [compute_slots(order) for order in orders]
    deps = slot_dependencies(config, slots)
    columns: list[list[int]] = [[] for _ in orders]
    progress = True
    while progress:
        progress = False
        for rank, rank_slots in enumerate(slots):
            placed = columns[rank]
            while len(placed) < len(rank_slots):
                needed = deps[rank][len(placed)]
                if any(slot >= len(columns[other]) for other, slot in needed):
                    break
                column = placed[-1] + 1 if placed else 0
                for other, slot in needed:
                    column = max(column, columns[other][slot] + 1)
                placed.append(column)
                progress = True
    stuck = {
        rank: rank_slots[len(columns[rank])].index
        for rank, rank_slots in enumerate(slots)
        if len(columns[rank]) < len(rank_slots)
    }
    if stuck:
        where = ", ".join(f"rank {r} at {orders[r][i].short()}" for r, i in stuck.items())
        raise ScheduleDeadlockError(
            f"orders cannot complete, their compute slots wait on each other: {where}", stuck
        )
    num_columns = max((cols[-1] + 1 for cols in columns if cols), default=0)
    cells = tuple(
        tuple(
            TimelineCell(rank=rank, slot=s.slot, index=s.index, column=col, step=s.step)
            for s, col in zip(rank_slots, columns[rank], strict=True)
        )
        for rank, rank_slots in enumerate(slots)
    )
    bubbles = tuple(num_columns - len(rank_cells) for rank_cells in cells)
    return Timeline(num_columns=num_columns, cells=cells, bubbles=bubbles)


def split_release_kind(saved_until: SavedUntil) -> StepKind:
    """The half of a split backward that frees its chunk's saved tensors: BWD_INPUT for
    ``saved_until="input"``, BWD_WEIGHT for ``"weight"``."""
    check_one_of("saved_until", saved_until, SAVED_UNTIL)
    return BWD_INPUT if saved_until == "input" else BWD_WEIGHT


def releases_chunk(kind: StepKind, split_release: StepKind) -> bool:
    """Whether a compute leaf of ``kind`` frees its chunk: a BWD, or the split half
    ``split_release`` (:func:`split_release_kind`)."""
    return kind is BWD or kind is split_release


def memory_profile(
    order: Order, *, with_swap: bool = True, saved_until: SavedUntil = "input"
) -> tuple[int, ...]:
    """Resident activation chunks at each top-level step of ``order`` (see module doc).

    With ``with_swap=False`` the swap steps are ignored (they keep their entry, unchanged
    from the step before), which is the same as the profile of the order without them.
    ``saved_until``: where a split chunk is released (``ScheduleConfig.saved_until``).
    """
    if not isinstance(with_swap, bool):
        raise TypeError(f"with_swap must be a bool, got {with_swap!r}")
    return _walk(order, with_swap, split_release_kind(saved_until), None, None)


def saved_bytes_profile(
    order: Order,
    *,
    kept: Sequence[int],
    moved: Sequence[int],
    with_swap: bool = True,
    saved_until: SavedUntil = "input",
) -> tuple[int, ...]:
    """:func:`memory_profile` in bytes: a chunk of stage ``s`` holds ``kept[s]`` bytes
    from its FWD to its release and ``kept[s] - moved[s]`` while it is swapped out
    (``kept`` and ``moved`` indexed by global stage; ``0 <= moved[s] <= kept[s]``). With
    ``kept == moved == 1`` on every stage it is :func:`memory_profile`."""
    if not isinstance(with_swap, bool):
        raise TypeError(f"with_swap must be a bool, got {with_swap!r}")
    split_release = split_release_kind(saved_until)
    if len(kept) != len(moved):
        raise ValueError(
            f"kept and moved must hold one int per stage each, got {len(kept)} and {len(moved)}"
        )
    for stage, (whole, part) in enumerate(zip(kept, moved, strict=True)):
        if not (isinstance(whole, int) and isinstance(part, int) and 0 <= part <= whole):
            raise ValueError(
                f"kept and moved must be ints with 0 <= moved <= kept, got kept={whole!r} "
                f"and moved={part!r} for stage {stage}"
            )
    stages = {leaf.stage for leaf in iter_leaves(order) if leaf.kind in COMPUTE_KINDS}
    if stages and max(stages) >= len(kept):
        raise ValueError(
            f"kept and moved hold {len(kept)} stages; the order runs stage {max(stages)}"
        )
    return _walk(order, with_swap, split_release, kept, moved)


def _walk(
    order: Order,
    with_swap: bool,
    split_release: StepKind,
    kept: Sequence[int] | None,
    moved: Sequence[int] | None,
) -> tuple[int, ...]:
    """The profile of the module doc; a chunk of stage ``s`` weighs ``kept[s]`` and moves
    ``moved[s]`` (1 and 1 where None)."""
    slot_at = {slot.index: slot for slot in compute_slots(order)}
    resident = 0
    profile: list[int] = []
    for index, step in enumerate(order):
        slot = slot_at.get(index)
        if slot is not None:
            produced = consumed = 0
            for leaf in slot.leaves:
                weight = 1 if kept is None else kept[leaf.stage]
                if leaf.kind is FWD:
                    produced += weight
                elif releases_chunk(leaf.kind, split_release):
                    consumed += weight
            profile.append(resident + produced)
            resident += produced - consumed
            continue
        if with_swap and step.kind is SWAP_WAIT_OFFLOAD:
            resident -= 1 if moved is None else moved[step.stage]
        elif with_swap and step.kind is SWAP_LAUNCH_LOAD:
            resident += 1 if moved is None else moved[step.stage]
        profile.append(resident)
    return tuple(profile)


def step_columns(timeline: Timeline, rank: int, order: Order) -> tuple[int, ...]:
    """The logical column of every top-level step of rank ``rank``'s ``order``.

    A compute slot is at its column. Every other step (P2P, FSDP, swap launches and
    waits) runs as soon as the previous compute slot ends, at that slot's column + 1 (0
    before the first slot, clamped to the last column after the last one): only compute
    waits for data from other ranks, so in a bubble the rank's non-compute steps have
    already run when the bubble starts. A copy is taken to fit in one compute slot.
    Columns never decrease along the order.
    """
    cells = timeline.cells[rank]
    if len(cells) != len(compute_slots(order)):
        raise ValueError(
            f"order does not match the timeline of rank {rank}: "
            f"{len(compute_slots(order))} compute slots against {len(cells)}"
        )
    last = max(timeline.num_columns - 1, 0)
    column_at = {cell.index: cell.column for cell in cells}
    out: list[int] = []
    after_previous = 0
    for index in range(len(order)):
        if index in column_at:
            out.append(column_at[index])
            after_previous = column_at[index] + 1
        else:
            out.append(min(after_previous, last))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class CopyWindow:
    """A static launch-to-wait window of one chunk's copy on the logical time axis.

    ``kind`` is ``"offload"`` (SWAP_LAUNCH_OFFLOAD to SWAP_WAIT_OFFLOAD) or ``"load"``
    (SWAP_LAUNCH_LOAD to SWAP_WAIT_LOAD); ``start``/``end`` are columns from
    ``step_columns`` (``end == start`` when the wait directly follows the launch).
    """

    kind: str
    stage: int
    micro: int
    start: int
    end: int


def copy_windows(timeline: Timeline, rank: int, order: Order) -> tuple[CopyWindow, ...]:
    """The offload and load windows of every eligible chunk of ``rank``, by launch order."""
    columns = step_columns(timeline, rank, order)
    launched: dict[tuple[StepKind, tuple[int, int]], int] = {}
    windows: list[tuple[int, CopyWindow]] = []
    for index, (step, column) in enumerate(zip(order, columns, strict=True)):
        if step.kind in SWAP_LAUNCH_KINDS:
            launched[(step.kind, step.chunk)] = index
        elif step.kind in LAUNCH_OF_WAIT:
            launch_kind = LAUNCH_OF_WAIT[step.kind]
            name = "offload" if launch_kind is SWAP_LAUNCH_OFFLOAD else "load"
            start_index = launched.pop((launch_kind, step.chunk), None)
            if start_index is None:
                raise ValueError(f"{step.short()} of rank {rank} has no launch before it")
            window = CopyWindow(name, step.stage, step.micro, columns[start_index], column)
            windows.append((start_index, window))
    return tuple(window for _, window in sorted(windows, key=lambda item: item[0]))


def resident_by_column(
    timeline: Timeline,
    rank: int,
    order: Order,
    *,
    with_swap: bool = True,
    saved_until: SavedUntil = "input",
) -> tuple[int, ...]:
    """Resident chunks of ``rank`` in every column: the largest profile value of the steps
    in that column, or the value carried from before when the column has none (a bubble).
    Its maximum equals ``max(memory_profile(order, with_swap=..., saved_until=...))``.
    """
    profile = memory_profile(order, with_swap=with_swap, saved_until=saved_until)
    columns = step_columns(timeline, rank, order)
    per_column: list[int | None] = [None] * timeline.num_columns
    for column, value in zip(columns, profile, strict=True):
        current = per_column[column]
        per_column[column] = value if current is None else max(current, value)
    out: list[int] = []
    carried = 0
    index = 0
    for column, peak in enumerate(per_column):
        while index < len(columns) and columns[index] <= column:
            carried = profile[index]
            index += 1
        out.append(carried if peak is None else peak)
    return tuple(out)


def memory_table(config: ScheduleConfig) -> list[dict[str, int]]:
    """Per rank: eligible chunks and the peak resident chunks without and with swap.

    The orders are lowered with ``swap=True`` whatever ``config.swap`` says (the table is
    the prediction for a swap run); ``peak_chunks_no_swap`` is the same order with the swap
    steps ignored; a split chunk is released as ``config.saved_until`` says. Keys:
    ``rank``, ``peak_chunks_no_swap``, ``peak_chunks_swap``, ``eligible`` (the number of
    eligible chunks of the rank).
    """
    if not isinstance(config, ScheduleConfig):
        raise TypeError(f"config must be a ScheduleConfig, got {type(config).__name__}")
    orders = build_all_orders(replace(config, swap=True))
    return memory_rows(orders, saved_until=config.saved_until)


def memory_rows(
    orders: Sequence[Order], *, saved_until: SavedUntil = "input"
) -> list[dict[str, int]]:
    """:func:`memory_table`'s rows for any finalized orders (one per rank), such as those of
    another swap policy (``cost.build_orders``); ``eligible`` counts the chunks the orders
    swap; ``saved_until`` as in :func:`memory_profile`."""
    return [
        {
            "rank": rank,
            "peak_chunks_no_swap": max(
                memory_profile(order, with_swap=False, saved_until=saved_until), default=0
            ),
            "peak_chunks_swap": max(memory_profile(order, saved_until=saved_until), default=0),
            "eligible": len(eligible_chunks(order)),
        }
        for rank, order in enumerate(orders)
    ]
