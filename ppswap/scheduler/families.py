"""The rules and stage placement of the zero-bubble, V-shape and looped schedule families.

Pure functions of ``(schedule, pp, vpp, micro)``, used by ``ScheduleConfig`` to refuse a
configuration a family cannot serve and to place its stages. The rules are those of
torch.distributed.pipelining (2.13), whose orders these families reproduce:

``looped_bfs``
    any ``vpp >= 1`` and ``micro >= 1``.
``interleaved_zb``
    any ``vpp >= 1``; ``micro`` a multiple of its number of rounds ``max(1, micro // pp)``.
``zbv``
    ``vpp == 2``; any ``micro >= 1``.
``dualpipev``
    ``vpp == 2`` and ``micro >= 2 * pp`` (at least one micro-batch per stage). torch
    accepts an odd ``pp`` for the V variant (only DeepSeek's two-way DualPipe needs an even
    one), and so does ppswap.

Placement. Loop placement puts stage ``s`` on rank ``s % pp``. The V families (``zbv``,
``dualpipev``) fold the pipeline back: stage ``s`` lives on rank ``s`` for ``s < pp`` and
on rank ``2 * pp - 1 - s`` above, so rank ``r`` holds stages ``r`` and ``2 * pp - 1 - r``
and the last rank holds the V's turn (stages ``pp - 1`` and ``pp``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ppswap.scheduler.steps import Order

__all__ = [
    "COMPOSITE_FAMILIES",
    "FAMILIES",
    "SPLIT_FAMILIES",
    "V_FAMILIES",
    "ComputeOrders",
    "check_family",
    "rounds_of",
    "v_rank_of",
    "v_stages_of",
]

FAMILIES: tuple[str, ...] = ("looped_bfs", "interleaved_zb", "zbv", "dualpipev")
"""The families of this module, in the order ``ppswap plan`` lists them."""
V_FAMILIES = frozenset({"zbv", "dualpipev"})
SPLIT_FAMILIES = frozenset({"interleaved_zb", "zbv", "dualpipev"})
"""Families whose orders split backwards into BWD_INPUT and BWD_WEIGHT (on every stage)."""
COMPOSITE_FAMILIES = frozenset({"dualpipev"})
"""Families whose orders hold OVERLAP_F_B composites."""


def rounds_of(pp: int, micro: int) -> int:
    """torch's number of rounds of an interleaved order: ``max(1, micro // pp)``."""
    return max(1, micro // pp)


def check_family(schedule: str, pp: int, vpp: int, micro: int) -> None:
    """Raise ValueError (one line: the parameter, the value, the rule) unless ``schedule``
    (one of ``FAMILIES``) can serve ``pp`` ranks, ``vpp`` stages per rank, ``micro``
    micro-batches. The ints are already checked to be >= 1."""
    if schedule in V_FAMILIES and vpp != 2:
        raise ValueError(f"vpp must be 2 for {schedule} (a V: two stages per rank), got {vpp!r}")
    if schedule == "dualpipev" and micro < 2 * pp:
        raise ValueError(
            f"micro must be >= 2 * pp = {2 * pp} for dualpipev (at least one micro-batch "
            f"per stage), got {micro!r}"
        )
    if schedule == "interleaved_zb":
        rounds = rounds_of(pp, micro)
        if micro % rounds != 0:
            raise ValueError(
                f"micro must be a multiple of its rounds max(1, micro // pp) = {rounds} "
                f"for interleaved_zb with pp={pp}, got {micro!r}"
            )


def v_rank_of(pp: int, stage: int) -> int:
    """V placement: stage ``s`` on rank ``s`` below ``pp``, on ``2 * pp - 1 - s`` above."""
    return stage if stage < pp else 2 * pp - 1 - stage


def v_stages_of(pp: int, rank: int) -> tuple[int, ...]:
    """The two stages of ``rank`` under V placement, first leg first."""
    return (rank, 2 * pp - 1 - rank)


@dataclass(frozen=True, slots=True)
class ComputeOrders:
    """Every rank's compute order given from outside (a user's order), and the stage
    placement it implies: ``placement[s]`` is the rank that runs stage ``s``.

    Built and checked by ``ppswap.scheduler.user_orders``; ``ScheduleConfig(order=...)``
    then runs these orders instead of a family's.
    """

    orders: tuple[Order, ...]
    placement: tuple[int, ...]
