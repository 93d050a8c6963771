"""ScheduleConfig: the one validated description of a pipeline schedule.

Every scheduler pass takes a ScheduleConfig; it is checked once, here, so that bad input
fails before anything is built or run, with an error naming the parameter, the value and
what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from ppswap.scheduler.checks import check_bool, check_int, check_one_of
from ppswap.scheduler.families import (
    COMPOSITE_FAMILIES,
    FAMILIES,
    SPLIT_FAMILIES,
    V_FAMILIES,
    ComputeOrders,
    check_family,
    v_rank_of,
    v_stages_of,
)

__all__ = [
    "DEFAULT_MIN_SWAP_GAP",
    "P2PMode",
    "SavedUntil",
    "ScheduleConfig",
    "ScheduleName",
    "check_schedule_options",
]

ScheduleName = Literal[
    "gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv", "dualpipev"
]
P2PMode = Literal["plain", "batch", "boundary"]
SavedUntil = Literal["input", "weight"]
"""When a chunk whose backward is split (BWD_INPUT, then BWD_WEIGHT) frees its saved
tensors: ``"input"`` at its BWD_INPUT (MindSpore computes dx and dw there), ``"weight"``
at its BWD_WEIGHT (torch's weight pass reads the graph's saved tensors)."""
SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)
P2P_MODES: tuple[str, ...] = get_args(P2PMode)
SAVED_UNTIL: tuple[str, ...] = get_args(SavedUntil)
DEFAULT_MIN_SWAP_GAP = 4


def check_schedule_options(
    *,
    schedule: object,
    split_dw: object,
    overlap_b_f: object,
    p2p: object,
    swap: object,
    min_swap_gap: object,
    forward_only: object,
) -> None:
    """Check the options of a schedule that need no sizes (pp, vpp, micro): each one's
    type and range, and the rules between them. ``ScheduleConfig`` runs this first;
    ``RunOptions`` (``ppswap.options``), whose fields these are too, when it is made.
    TypeError / ValueError naming the parameter, the value and what is allowed."""
    check_one_of("schedule", schedule, SCHEDULE_NAMES)
    check_bool("split_dw", split_dw)
    check_bool("overlap_b_f", overlap_b_f)
    check_bool("swap", swap)
    check_bool("forward_only", forward_only)
    check_one_of("p2p", p2p, P2P_MODES)
    check_int("min_swap_gap", min_swap_gap, 2)
    if overlap_b_f and schedule == "gpipe":
        raise ValueError(
            "overlap_b_f needs a steady state where a backward is followed by a "
            "forward; schedule 'gpipe' has none. Use schedule='1f1b' or "
            "'interleaved_1f1b', or overlap_b_f=False"
        )
    if forward_only and swap:
        raise ValueError(
            "swap must be False for a forward-only run, got swap=True "
            "(there is no backward to load the activations for)"
        )
    if forward_only and (split_dw or overlap_b_f):
        raise ValueError(
            "split_dw and overlap_b_f need a backward; they must be False with forward_only=True"
        )


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """A pipeline schedule: family, sizes and options.

    ``pp`` ranks, ``vpp`` virtual stages per rank (stages ``0 .. pp*vpp-1``, stage ``s`` on
    rank ``rank_of(s)``), ``micro`` micro-batches. ``vpp > 1`` only with
    ``interleaved_1f1b``, which needs ``vpp >= 2`` and ``micro % pp == 0``, or with the
    families of ``ppswap.scheduler.families`` (their own rules). ``order``: every rank's
    compute order given from outside (``ppswap.scheduler.user_orders``); it replaces the
    family's order and placement, and ``schedule`` is then only a label.
    ``saved_until``: the framework's release point of a split chunk (:data:`SavedUntil`),
    set by run planning from the backend; every memory prediction reads it.
    """

    schedule: ScheduleName = "gpipe"
    pp: int = 1
    vpp: int = 1
    micro: int = 1
    split_dw: bool = False
    overlap_b_f: bool = False
    p2p: P2PMode = "plain"
    fsdp: bool = False
    swap: bool = False
    min_swap_gap: int = DEFAULT_MIN_SWAP_GAP
    forward_only: bool = False
    order: ComputeOrders | None = None
    saved_until: SavedUntil = "input"

    def __post_init__(self) -> None:
        check_schedule_options(
            schedule=self.schedule,
            split_dw=self.split_dw,
            overlap_b_f=self.overlap_b_f,
            p2p=self.p2p,
            swap=self.swap,
            min_swap_gap=self.min_swap_gap,
            forward_only=self.forward_only,
        )
        check_int("pp", self.pp, 1)
        check_int("vpp", self.vpp, 1)
        check_int("micro", self.micro, 1)
        check_bool("fsdp", self.fsdp)
        check_one_of("saved_until", self.saved_until, SAVED_UNTIL)
        if self.order is not None:
            self._check_order()
        elif self.schedule in FAMILIES:
            check_family(self.schedule, self.pp, self.vpp, self.micro)
            if self.split_dw or self.overlap_b_f:
                raise ValueError(
                    f"split_dw and overlap_b_f must be False for {self.schedule} (its order "
                    "fixes its own backward split and overlap)"
                )
        elif self.schedule == "interleaved_1f1b":
            if self.vpp < 2:
                raise ValueError(
                    f"vpp must be >= 2 for interleaved_1f1b, got {self.vpp!r} "
                    "(use schedule='1f1b' for one stage per rank)"
                )
            if self.micro % self.pp != 0:
                raise ValueError(
                    f"micro must be a multiple of pp={self.pp} for interleaved_1f1b, "
                    f"got {self.micro!r}"
                )
        elif self.vpp != 1:
            raise ValueError(
                f"vpp must be 1 for schedule {self.schedule!r}, got {self.vpp!r} "
                "(virtual stages need schedule='interleaved_1f1b')"
            )

    def _check_order(self) -> None:
        order = self.order
        if not isinstance(order, ComputeOrders):
            raise TypeError(f"order must be a ComputeOrders or None, got {type(order).__name__}")
        if len(order.orders) != self.pp or len(order.placement) != self.num_stages:
            raise ValueError(
                f"order must hold {self.pp} ranks' orders over {self.num_stages} stages "
                f"(pp={self.pp}, vpp={self.vpp}), got {len(order.orders)} ranks and "
                f"{len(order.placement)} stages"
            )
        if self.split_dw or self.overlap_b_f:
            raise ValueError(
                "split_dw and overlap_b_f must be False with a given order (the order "
                "says where backwards split and overlap)"
            )

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    @property
    def splits_backward(self) -> bool:
        """Whether orders may hold BWD_INPUT / BWD_WEIGHT: ``split_dw``, a zero-bubble
        family (split on every stage) or a given order."""
        return self.split_dw or self.order is not None or self.schedule in SPLIT_FAMILIES

    @property
    def has_composites(self) -> bool:
        """Whether orders may hold composites: ``overlap_b_f``, DualPipeV or a given order."""
        return self.overlap_b_f or self.order is not None or self.schedule in COMPOSITE_FAMILIES

    def rank_of(self, stage: int) -> int:
        """The rank stage ``s`` lives on: the given order's placement; V placement
        (``families.v_rank_of``) for zbv and dualpipev; else loop placement ``s % pp``."""
        if self.order is not None:
            return self.order.placement[stage]
        if self.schedule in V_FAMILIES:
            return v_rank_of(self.pp, stage)
        return stage % self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The global stages of a rank, in virtual-stage order (a V: down leg first)."""
        if self.order is not None:
            return tuple(s for s, r in enumerate(self.order.placement) if r == rank)
        if self.schedule in V_FAMILIES:
            return v_stages_of(self.pp, rank)
        return tuple(rank + v * self.pp for v in range(self.vpp))

    def placement(self) -> tuple[int, ...]:
        """``rank_of`` of every stage, indexed by stage (for hot loops)."""
        return tuple(self.rank_of(stage) for stage in range(self.num_stages))
