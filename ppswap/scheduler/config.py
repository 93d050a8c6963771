"""ScheduleConfig: the one validated description of a pipeline schedule.

Every scheduler pass takes a ScheduleConfig; it is checked once, here, so that bad input
fails before anything is built or run, with an error naming the parameter, the value and
what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, get_args

__all__ = [
    "DEFAULT_MIN_SWAP_GAP",
    "P2PMode",
    "ScheduleConfig",
    "ScheduleName",
]

ScheduleName = Literal["gpipe", "1f1b", "interleaved_1f1b"]
P2PMode = Literal["plain", "batch", "boundary"]
SCHEDULE_NAMES: tuple[str, ...] = get_args(ScheduleName)
P2P_MODES: tuple[str, ...] = get_args(P2PMode)
DEFAULT_MIN_SWAP_GAP = 4


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool (True or False), got {value!r}")


@dataclass(frozen=True, slots=True)
class ScheduleConfig:
    """A pipeline schedule: family, sizes and options.

    ``pp`` ranks, ``vpp`` virtual stages per rank (stages ``0 .. pp*vpp-1``, stage ``s`` on
    rank ``s % pp``), ``micro`` micro-batches. ``vpp > 1`` only with ``interleaved_1f1b``,
    which needs ``vpp >= 2`` and ``micro % pp == 0``.
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

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(
                f"schedule must be one of {', '.join(SCHEDULE_NAMES)}, got {self.schedule!r}"
            )
        _check_int("pp", self.pp, 1)
        _check_int("vpp", self.vpp, 1)
        _check_int("micro", self.micro, 1)
        for flag in ("split_dw", "overlap_b_f", "fsdp", "swap", "forward_only"):
            _check_bool(flag, getattr(self, flag))
        if self.p2p not in P2P_MODES:
            raise ValueError(f"p2p must be one of {', '.join(P2P_MODES)}, got {self.p2p!r}")
        _check_int("min_swap_gap", self.min_swap_gap, 2)
        if self.schedule == "interleaved_1f1b":
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
        if self.overlap_b_f and self.schedule == "gpipe":
            raise ValueError(
                "overlap_b_f needs a steady state where a backward is followed by a "
                "forward; schedule 'gpipe' has none. Use schedule='1f1b' or "
                "'interleaved_1f1b', or overlap_b_f=False"
            )
        if self.forward_only and self.swap:
            raise ValueError(
                "swap must be False for a forward-only run, got swap=True "
                "(there is no backward to load the activations for)"
            )
        if self.forward_only and (self.split_dw or self.overlap_b_f):
            raise ValueError(
                "split_dw and overlap_b_f need a backward; they must be False with "
                "forward_only=True"
            )

    @property
    def num_stages(self) -> int:
        return self.pp * self.vpp

    def rank_of(self, stage: int) -> int:
        """Loop placement: stage ``s`` lives on rank ``s % pp``."""
        return stage % self.pp

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The global stages of a rank, in virtual-stage order."""
        return tuple(rank + v * self.pp for v in range(self.vpp))
