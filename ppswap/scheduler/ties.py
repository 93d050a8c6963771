"""Tied parameters in the plan: where each rank sums a tied parameter's gradients.

A *tie* is a parameter that several stages hold (the same object in one process, or
copies declared with one key across processes: a GPT-2 head that multiplies by the input
embedding's weight). After the stages' backwards each holder's gradient of it is only its
own stage's share; TIED_GRAD_SUM makes every holder's gradient the sum over the holders,
added in stage order, so every holder gets the same bits.

The step is the last of a holder rank's order (after its last backward of every stage:
all its shares are complete), one per tie with a stage on that rank, ``micro == -1``,
``stage`` the rank's last holder stage. It is a collective among the holder ranks, one
per tie; a tie whose holders are all on one rank (two virtual stages of one rank) sums
locally. Pure: orders in, orders out.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import TIED_GRAD_SUM, MetaStep, Order

__all__ = ["check_tie_groups", "with_tie_steps"]


def check_tie_groups(config: ScheduleConfig, groups: Sequence[Sequence[int]]) -> None:
    """Raise ValueError unless each group names two or more distinct stages of the run."""
    for group in groups:
        stages = list(group)
        bad = [s for s in stages if not isinstance(s, int) or not 0 <= s < config.num_stages]
        if bad or len(set(stages)) != len(stages) or len(stages) < 2:
            raise ValueError(
                f"a tie must name two or more distinct stages in 0..{config.num_stages - 1}, "
                f"got {stages}"
            )


def with_tie_steps(
    config: ScheduleConfig, orders: Sequence[Order], groups: Sequence[Sequence[int]]
) -> tuple[Order, ...]:
    """``orders`` (index ``w``: pipeline rank ``w % pp``; FSDP's world orders too) with a
    TIED_GRAD_SUM appended per tie group that has a stage on the rank, groups taken in
    order of their first stage."""
    check_tie_groups(config, groups)
    ordered = sorted((sorted(group) for group in groups), key=lambda stages: stages[0])
    out: list[Order] = []
    for index, order in enumerate(orders):
        rank = index % config.pp
        tail = [
            MetaStep(TIED_GRAD_SUM, mine[-1], -1)
            for stages in ordered
            if (mine := [s for s in stages if config.rank_of(s) == rank])
        ]
        out.append((*order, *tail))
    return tuple(out)
