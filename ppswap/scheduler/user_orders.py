"""Orders a user writes: torch.distributed.pipelining's action notation in and out.

A user order is every rank's compute order, written as torch writes its actions:
``"0F0"`` (stage 0, forward, micro-batch 0), ``"1I0"`` (BWD_INPUT), ``"1W0"``
(BWD_WEIGHT), ``"2B1"`` (full backward), and an overlapped pair as torch writes it,
``"(0F3;3B1)OVERLAP_F_B"`` (one compute slot running the forward and the backward
together). ppswap's own backward-first pair is written ``"(3B1;0F3)OVERLAP_B_F"`` (an
extension: torch has no such type). An empty cell (torch's bubble, ``None``) is skipped.

``read_orders(spec)`` takes a path to the CSV torch's schedules write (``_dump_csv``: one
row per rank, one action per cell, compute actions only), or rows of action strings (a
sequence of rows, or a mapping rank -> row), and returns each rank's order of MetaSteps.
``check_orders_given(orders, num_stages, micro)`` checks them before anything runs and
returns the ``ComputeOrders`` a ``ScheduleConfig(order=...)`` runs: the placement (which
rank runs each stage) is read from the orders, as torch reads it. Every error is one
line naming the rank, the position (the action's index in the rank's row, bubbles
skipped) and the action:

- an action that is not compute (SEND_F, UNSHARD ...) or not in the notation;
- an unknown stage (outside ``0 .. num_stages - 1``) or micro-batch, a stage run by two
  ranks, or a stage no rank runs;
- a repeated action; a missing one (a chunk without its forward, without a backward, a
  BWD_INPUT without its BWD_WEIGHT, or with both a full backward and a split one);
- a backward before its forward, a BWD_WEIGHT before its BWD_INPUT;
- a cross-rank cycle: the orders, played together (an action runs once the actions whose
  outputs it reads have run), stop with every unfinished rank waiting; the error names
  each waiting rank's action and what it waits for.

``format_orders(orders)`` writes ppswap's compute orders in the same notation and
``write_csv`` / ``csv_text`` as torch's CSV: ``read_orders`` of it gives the orders back.
"""

from __future__ import annotations

import csv
import io
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from ppswap.scheduler.families import ComputeOrders
from ppswap.scheduler.steps import MetaStep, Order, StepKind

__all__ = [
    "OrderSpec",
    "UserOrderError",
    "check_orders_given",
    "csv_text",
    "format_action",
    "format_orders",
    "parse_action",
    "read_orders",
    "write_csv",
]

OrderSpec = (
    str | os.PathLike[str] | Sequence[Sequence[str | None]] | Mapping[int, Sequence[str | None]]
)
"""What ``order=`` accepts: a CSV path, or rows of action strings (by rank)."""

_ACTION = re.compile(r"(\d+)([FIBW])(\d+)")
_PAIR = re.compile(r"\(([^;()]+);([^;()]+)\)(OVERLAP_F_B|OVERLAP_B_F)")
_LETTER = {"F": StepKind.FWD, "I": StepKind.BWD_INPUT, "W": StepKind.BWD_WEIGHT, "B": StepKind.BWD}
_LETTER_OF = {kind: letter for letter, kind in _LETTER.items()}
_COMPOSITE = {"OVERLAP_F_B": StepKind.OVERLAP_F_B, "OVERLAP_B_F": StepKind.OVERLAP_B_F}


class UserOrderError(ValueError):
    """A user order that cannot run; the message names the rank, position and action."""


def parse_action(text: str) -> MetaStep:
    """One compute action in torch's notation (module docstring) as a MetaStep."""
    text = text.strip()
    pair = _PAIR.fullmatch(text)
    if pair is not None:
        first, second = parse_action(pair.group(1)), parse_action(pair.group(2))
        kind = _COMPOSITE[pair.group(3)]
        forward, backward = (first, second) if kind is StepKind.OVERLAP_F_B else (second, first)
        if forward.kind is not StepKind.FWD or backward.kind not in (
            StepKind.BWD,
            StepKind.BWD_INPUT,
        ):
            raise ValueError(f"{text!r}: {pair.group(3)} pairs a forward with a B or I backward")
        return MetaStep(kind, first.stage, first.micro, None, (first, second))
    single = _ACTION.fullmatch(text)
    if single is None:
        raise ValueError(
            f"{text!r} is not a compute action (<stage><F|I|W|B><micro> such as 2F0, or "
            "(<F action>;<B action>)OVERLAP_F_B)"
        )
    return MetaStep(_LETTER[single.group(2)], int(single.group(1)), int(single.group(3)))


def format_action(step: MetaStep) -> str:
    """A compute slot in torch's notation: the inverse of ``parse_action``."""
    if step.sub_steps:
        inner = ";".join(format_action(sub) for sub in step.sub_steps)
        return f"({inner}){step.kind.value}"
    return f"{step.stage}{_LETTER_OF[step.kind]}{step.micro}"


def format_orders(orders: Sequence[Order]) -> list[list[str]]:
    """Every rank's compute slots in torch's notation (compute slots only, in order)."""
    return [[format_action(step) for step in order if step.is_compute] for order in orders]


def csv_text(orders: Sequence[Order]) -> str:
    """The CSV torch's ``_dump_csv(format="compute_only")`` writes: one row per rank."""
    out = io.StringIO()
    writer = csv.writer(out)
    for row in format_orders(orders):
        writer.writerow(row)
    return out.getvalue()


def write_csv(orders: Sequence[Order], path: str | os.PathLike[str]) -> None:
    """Write ``csv_text(orders)`` to ``path``."""
    Path(path).write_text(csv_text(orders), newline="")


def _rows(spec: OrderSpec) -> list[Sequence[str | None]]:
    if isinstance(spec, str | os.PathLike):
        path = Path(spec)
        if not path.is_file():
            raise FileNotFoundError(
                f"order must be a CSV file or rows of actions, got {str(spec)!r} (no such file)"
            )
        with path.open(newline="") as handle:
            return list(csv.reader(handle))
    if isinstance(spec, Mapping):
        ranks = sorted(spec)
        if ranks != list(range(len(ranks))):
            raise ValueError(f"order must map ranks 0..n-1 to rows, got ranks {ranks}")
        return [spec[rank] for rank in ranks]
    if isinstance(spec, Sequence):
        return list(spec)
    raise TypeError(
        f"order must be a CSV path or rows of action strings, got {type(spec).__name__}"
    )


def read_orders(spec: OrderSpec) -> tuple[Order, ...]:
    """Each rank's compute order from a CSV path or rows of action strings."""
    orders: list[Order] = []
    for rank, row in enumerate(_rows(spec)):
        if isinstance(row, str):
            raise TypeError(f"order rank {rank}: a row must be a sequence of actions, got a str")
        steps: list[MetaStep] = []
        for cell in row:
            if cell is None or not str(cell).strip():
                continue  # a bubble
            try:
                steps.append(parse_action(str(cell)))
            except ValueError as exc:
                raise UserOrderError(f"order rank {rank} position {len(steps)}: {exc}") from None
        orders.append(tuple(steps))
    if not orders:
        raise UserOrderError("order must hold one row per rank, got no rows")
    return tuple(orders)


def _where(rank: int, position: int, step: MetaStep) -> str:
    return f"order rank {rank} position {position} ({format_action(step)})"


def _placement(orders: Sequence[Order], num_stages: int, micro: int) -> tuple[int, ...]:
    owner: dict[int, int] = {}
    for rank, order in enumerate(orders):
        for position, slot in enumerate(order):
            for leaf in slot.sub_steps or (slot,):
                where = _where(rank, position, leaf)
                if not 0 <= leaf.stage < num_stages:
                    raise UserOrderError(
                        f"{where}: unknown stage {leaf.stage}; the stages are 0..{num_stages - 1}"
                    )
                if not 0 <= leaf.micro < micro:
                    raise UserOrderError(
                        f"{where}: unknown micro-batch {leaf.micro}; they are 0..{micro - 1}"
                    )
                if owner.setdefault(leaf.stage, rank) != rank:
                    raise UserOrderError(
                        f"{where}: stage {leaf.stage} is already run by rank {owner[leaf.stage]}"
                    )
    for stage in range(num_stages):
        if stage not in owner:
            raise UserOrderError(f"order: no rank runs stage {stage} (missing {stage}F0)")
    return tuple(owner[stage] for stage in range(num_stages))


def _check_rank_chunks(rank: int, order: Order, stages: Sequence[int], micro: int) -> None:
    """Each chunk once forward, once backward (B, or I then W), in that order."""
    seen: dict[tuple[StepKind, int, int], int] = {}
    for position, slot in enumerate(order):
        for leaf in slot.sub_steps or (slot,):
            key = (leaf.kind, leaf.stage, leaf.micro)
            if key in seen:
                raise UserOrderError(
                    f"{_where(rank, position, leaf)}: repeated (first at position {seen[key]})"
                )
            seen[key] = position
    for stage in stages:
        for index in range(micro):

            def at(kind: StepKind, stage: int = stage, index: int = index) -> int | None:
                return seen.get((kind, stage, index))

            def name(kind: StepKind, stage: int = stage, index: int = index) -> str:
                return f"{stage}{_LETTER_OF[kind]}{index}"

            fwd, bwd = at(StepKind.FWD), at(StepKind.BWD)
            first, weight = at(StepKind.BWD_INPUT), at(StepKind.BWD_WEIGHT)
            backward = bwd if bwd is not None else first
            if fwd is None:
                hint = "" if backward is None else f" (its backward is at position {backward})"
                raise UserOrderError(f"order rank {rank}: missing {name(StepKind.FWD)}{hint}")
            if bwd is not None and (first is not None or weight is not None):
                other = first if first is not None else weight
                raise UserOrderError(
                    f"order rank {rank} position {other}: chunk {stage}/{index} has both "
                    f"{name(StepKind.BWD)} (position {bwd}) and a split backward"
                )
            if backward is None:
                raise UserOrderError(
                    f"order rank {rank}: missing {name(StepKind.BWD)} (or "
                    f"{name(StepKind.BWD_INPUT)} and {name(StepKind.BWD_WEIGHT)}) for "
                    f"{name(StepKind.FWD)} at position {fwd}"
                )
            if first is not None and weight is None:
                raise UserOrderError(
                    f"order rank {rank}: missing {name(StepKind.BWD_WEIGHT)} for "
                    f"{name(StepKind.BWD_INPUT)} at position {first}"
                )
            if first is None and weight is not None:
                raise UserOrderError(
                    f"order rank {rank} position {weight} ({name(StepKind.BWD_WEIGHT)}): "
                    f"missing {name(StepKind.BWD_INPUT)}"
                )
            if backward <= fwd:
                kind = StepKind.BWD if bwd is not None else StepKind.BWD_INPUT
                raise UserOrderError(
                    f"order rank {rank} position {backward} ({name(kind)}): backward before "
                    f"its forward {name(StepKind.FWD)} (position {fwd})"
                )
            if first is not None and weight is not None and weight <= first:
                raise UserOrderError(
                    f"order rank {rank} position {weight} ({name(StepKind.BWD_WEIGHT)}): before "
                    f"its {name(StepKind.BWD_INPUT)} (position {first})"
                )


def _needs(leaf: MetaStep, last_stage: int) -> tuple[StepKind, int, int] | None:
    """The action of another stage whose output ``leaf`` reads, if any."""
    if leaf.kind is StepKind.FWD:
        return None if leaf.stage == 0 else (StepKind.FWD, leaf.stage - 1, leaf.micro)
    if leaf.kind is StepKind.BWD_WEIGHT or leaf.stage == last_stage:
        return None
    return (StepKind.BWD, leaf.stage + 1, leaf.micro)  # BWD or BWD_INPUT of the next stage


def _check_progress(orders: Sequence[Order], num_stages: int) -> None:
    """Play the orders together; a cross-rank cycle stops every unfinished rank."""
    done: set[tuple[StepKind, int, int]] = set()
    cursor = [0] * len(orders)

    def key(leaf: MetaStep) -> tuple[StepKind, int, int]:
        kind = StepKind.BWD if leaf.kind is StepKind.BWD_INPUT else leaf.kind
        return (kind, leaf.stage, leaf.micro)

    def blocker(slot: MetaStep) -> tuple[StepKind, int, int] | None:
        for leaf in slot.sub_steps or (slot,):
            need = _needs(leaf, num_stages - 1)
            if need is not None and need not in done:
                return need
        return None

    progressed = True
    while progressed:
        progressed = False
        for rank, order in enumerate(orders):
            while cursor[rank] < len(order) and blocker(order[cursor[rank]]) is None:
                for leaf in order[cursor[rank]].sub_steps or (order[cursor[rank]],):
                    done.add(key(leaf))
                cursor[rank] += 1
                progressed = True
    waiting = [rank for rank, order in enumerate(orders) if cursor[rank] < len(order)]
    if waiting:
        parts = []
        for rank in waiting:
            slot = orders[rank][cursor[rank]]
            need = blocker(slot)
            assert need is not None
            letter = "B or I" if need[0] is StepKind.BWD else "F"
            parts.append(
                f"rank {rank} position {cursor[rank]} ({format_action(slot)}) waits for "
                f"stage {need[1]}'s {letter} of micro-batch {need[2]}"
            )
        raise UserOrderError("order has a cross-rank cycle: " + "; ".join(parts))


def check_orders_given(
    orders: Sequence[Order], num_stages: int, micro: int, *, forward_only: bool = False
) -> ComputeOrders:
    """Check user orders (module docstring) and return them with their placement.

    ``forward_only``: the orders may hold forwards only (an evaluation order); otherwise
    every chunk needs its backward.
    """
    orders = tuple(tuple(order) for order in orders)
    placement = _placement(orders, num_stages, micro)
    for rank, order in enumerate(orders):
        stages = [stage for stage, owner in enumerate(placement) if owner == rank]
        if forward_only:
            for position, slot in enumerate(order):
                if slot.kind is not StepKind.FWD:
                    raise UserOrderError(
                        f"{_where(rank, position, slot)}: a forward-only run takes forwards only"
                    )
            order_chunks: dict[tuple[int, int], int] = {}
            for position, slot in enumerate(order):
                first = order_chunks.setdefault(slot.chunk, position)
                if first != position:
                    raise UserOrderError(
                        f"{_where(rank, position, slot)}: repeated (first at position {first})"
                    )
            for stage in stages:
                for index in range(micro):
                    if (stage, index) not in order_chunks:
                        raise UserOrderError(f"order rank {rank}: missing {stage}F{index}")
        else:
            _check_rank_chunks(rank, order, stages, micro)
    _check_progress(orders, num_stages)
    return ComputeOrders(orders=orders, placement=placement)
