"""The MetaStep IR: one typed, frozen, hashable step of a rank's finalized order.

A rank's order is a ``tuple[MetaStep, ...]`` of top-level steps. Every scheduler pass is a
pure function from orders to new orders; nothing here ever mutates.

Conventions (fixed here, relied on everywhere):

- ``stage`` is a *global* stage index ``0 .. pp*vpp-1``; stage ``s`` lives on rank ``s % pp``.
- For P2P steps ``stage`` is the *local* stage (the sender's stage for SEND_*, the
  receiver's stage for RECV_*) and ``peer`` is the remote rank.
  ``SEND_F(s, i)`` on rank(s) pairs with ``RECV_F(s + 1, i)`` on rank(s + 1);
  ``SEND_B(s, i)`` on rank(s) pairs with ``RECV_B(s - 1, i)`` on rank(s - 1).
- FSDP steps are per stage, not per micro-batch: ``micro == -1``; so is TIED_GRAD_SUM,
  the sum of a tied parameter's gradients over the stages holding it (``stage``: this
  rank's last holder), the last step of a holder rank's order.
- Containers (BATCH_SEND_RECV) and composites (OVERLAP_B_F / OVERLAP_F_B) carry the stage
  and micro of their first sub-step; their meaning is in ``sub_steps``.
- Swap steps name the chunk ``(stage, micro)`` they move; RECOMPUTE names the chunk whose
  recompute-wrapped blocks it runs again (before the chunk's BWD / BWD_INPUT).
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

__all__ = [
    "BATCH_SEND_RECV",
    "BWD",
    "BWD_INPUT",
    "BWD_WEIGHT",
    "COMPOSITE_KINDS",
    "COMPUTE_KINDS",
    "CONSUMER_KINDS",
    "FSDP_KINDS",
    "FSDP_RESHARD",
    "FSDP_UNSHARD",
    "FWD",
    "LAUNCH_OF_WAIT",
    "LOCAL_KINDS",
    "OVERLAP_B_F",
    "OVERLAP_F_B",
    "P2P_KINDS",
    "PAYLOAD_MAKER_KINDS",
    "RECOMPUTE",
    "RECV_B",
    "RECV_F",
    "RECV_KINDS",
    "RUNS_MODULE_KINDS",
    "SEND_B",
    "SEND_F",
    "SEND_KINDS",
    "SEND_RECV_KINDS",
    "SWAP_KINDS",
    "SWAP_KIND_ORDER",
    "SWAP_LAUNCH_KINDS",
    "SWAP_LAUNCH_LOAD",
    "SWAP_LAUNCH_OFFLOAD",
    "SWAP_WAIT_KINDS",
    "SWAP_WAIT_LOAD",
    "SWAP_WAIT_OFFLOAD",
    "TIED_GRAD_SUM",
    "MetaStep",
    "Order",
    "StepKind",
    "iter_leaves",
    "trusted_step",
]


class StepKind(enum.Enum):
    """What a MetaStep does. The value is the name used in JSON and logs."""

    FWD = "FWD"
    BWD = "BWD"
    BWD_INPUT = "BWD_INPUT"
    BWD_WEIGHT = "BWD_WEIGHT"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    BATCH_SEND_RECV = "BATCH_SEND_RECV"
    OVERLAP_B_F = "OVERLAP_B_F"
    OVERLAP_F_B = "OVERLAP_F_B"
    FSDP_UNSHARD = "FSDP_UNSHARD"
    FSDP_RESHARD = "FSDP_RESHARD"
    SWAP_LAUNCH_OFFLOAD = "SWAP_LAUNCH_OFFLOAD"
    SWAP_WAIT_OFFLOAD = "SWAP_WAIT_OFFLOAD"
    SWAP_LAUNCH_LOAD = "SWAP_LAUNCH_LOAD"
    SWAP_WAIT_LOAD = "SWAP_WAIT_LOAD"
    TIED_GRAD_SUM = "TIED_GRAD_SUM"
    RECOMPUTE = "RECOMPUTE"

    # Members are singletons compared by identity: hash them by identity too (in C), not
    # by Enum's Python-level hash of the name. The planner and the runtime hash a kind at
    # almost every step (``kind in SOME_KINDS``, dicts keyed by kind).
    __hash__ = object.__hash__


# -- the vocabulary ----------------------------------------------------------------
# Every category of StepKind is defined here, once; the rest of the package imports it
# (tests/architecture/test_vocabulary.py refuses a module that builds its own).

# Each member as a module constant, for the hot loops (lowering builds ~10^5 steps for
# pp=32): CPython 3.11 reads a module global about 75 ns faster than ``StepKind.FWD``.
FWD = StepKind.FWD
BWD = StepKind.BWD
BWD_INPUT = StepKind.BWD_INPUT
BWD_WEIGHT = StepKind.BWD_WEIGHT
SEND_F = StepKind.SEND_F
RECV_F = StepKind.RECV_F
SEND_B = StepKind.SEND_B
RECV_B = StepKind.RECV_B
BATCH_SEND_RECV = StepKind.BATCH_SEND_RECV
OVERLAP_B_F = StepKind.OVERLAP_B_F
OVERLAP_F_B = StepKind.OVERLAP_F_B
FSDP_UNSHARD = StepKind.FSDP_UNSHARD
FSDP_RESHARD = StepKind.FSDP_RESHARD
SWAP_LAUNCH_OFFLOAD = StepKind.SWAP_LAUNCH_OFFLOAD
SWAP_WAIT_OFFLOAD = StepKind.SWAP_WAIT_OFFLOAD
SWAP_LAUNCH_LOAD = StepKind.SWAP_LAUNCH_LOAD
SWAP_WAIT_LOAD = StepKind.SWAP_WAIT_LOAD
TIED_GRAD_SUM = StepKind.TIED_GRAD_SUM
RECOMPUTE = StepKind.RECOMPUTE

COMPUTE_KINDS = frozenset({FWD, BWD, BWD_INPUT, BWD_WEIGHT})
"""The compute leaves: the steps that run the stage's module."""
CONSUMER_KINDS = frozenset({BWD, BWD_INPUT})
"""The backward that consumes a chunk's saved activations first and computes its input
gradient (the SEND_B payload): BWD, or BWD_INPUT with the dx/dw split."""
COMPOSITE_KINDS = frozenset({OVERLAP_B_F, OVERLAP_F_B})
"""Two independent compute leaves in one compute slot (``sub_steps``)."""
SEND_KINDS = frozenset({SEND_F, SEND_B})
RECV_KINDS = frozenset({RECV_F, RECV_B})
P2P_KINDS = SEND_KINDS | RECV_KINDS
"""The point-to-point leaves: each pairs with one step of the peer rank."""
SEND_RECV_KINDS = P2P_KINDS | {BATCH_SEND_RECV}
"""What a rank posts to its P2P channel: a P2P leaf or a BATCH_SEND_RECV of them."""
FSDP_KINDS = frozenset({FSDP_UNSHARD, FSDP_RESHARD})
"""The FSDP collectives, one per stage (``micro == -1``)."""
SWAP_KIND_ORDER: tuple[StepKind, ...] = (
    SWAP_LAUNCH_OFFLOAD,
    SWAP_WAIT_OFFLOAD,
    SWAP_LAUNCH_LOAD,
    SWAP_WAIT_LOAD,
)
"""Life-cycle order of the swap kinds; also the tie-break for steps at the same point."""
SWAP_KINDS = frozenset(SWAP_KIND_ORDER)
SWAP_LAUNCH_KINDS = frozenset({SWAP_LAUNCH_OFFLOAD, SWAP_LAUNCH_LOAD})
"""The copy launches: each queues one chunk's copy on the copy stream."""
SWAP_WAIT_KINDS = frozenset({SWAP_WAIT_OFFLOAD, SWAP_WAIT_LOAD})
"""The copy waits: each waits for the copy its launch (``LAUNCH_OF_WAIT``) started."""
LAUNCH_OF_WAIT: Mapping[StepKind, StepKind] = MappingProxyType(
    {SWAP_WAIT_OFFLOAD: SWAP_LAUNCH_OFFLOAD, SWAP_WAIT_LOAD: SWAP_LAUNCH_LOAD}
)
"""The launch whose copy each copy wait waits for (same chunk)."""
LOCAL_KINDS = COMPUTE_KINDS | SWAP_KINDS | {RECOMPUTE}
"""The local steps: they need no other rank, only their inputs (a received payload, a
copy's completion). RECOMPUTE is one, but not a compute slot: like a swap step it sits
between slots (``scheduler/recompute_plan.py``)."""
RUNS_MODULE_KINDS = COMPUTE_KINDS | {RECOMPUTE}
"""The steps that run the stage's module: the compute leaves and RECOMPUTE (FSDP installs
the gathered parameters before each; a fault plan's compute rules may name each)."""
PAYLOAD_MAKER_KINDS: Mapping[StepKind, frozenset[StepKind]] = MappingProxyType(
    {SEND_F: frozenset({FWD}), SEND_B: CONSUMER_KINDS}
)
"""The compute leaves whose result each send sends (same stage and micro-batch): a FWD's
output, a backward's input gradient."""

_P2P_VALUES = frozenset(kind.value for kind in P2P_KINDS)
_CONTAINER_VALUES = frozenset(
    [StepKind.BATCH_SEND_RECV.value, *(kind.value for kind in COMPOSITE_KINDS)]
)

_SHORT: dict[StepKind, str] = {
    StepKind.FWD: "F",
    StepKind.BWD: "B",
    StepKind.BWD_INPUT: "I",
    StepKind.BWD_WEIGHT: "W",
    StepKind.SEND_F: "SF",
    StepKind.RECV_F: "RF",
    StepKind.SEND_B: "SB",
    StepKind.RECV_B: "RB",
    StepKind.BATCH_SEND_RECV: "BATCH",
    StepKind.OVERLAP_B_F: "OBF",
    StepKind.OVERLAP_F_B: "OFB",
    StepKind.FSDP_UNSHARD: "UN",
    StepKind.FSDP_RESHARD: "RE",
    StepKind.SWAP_LAUNCH_OFFLOAD: "LO",
    StepKind.SWAP_WAIT_OFFLOAD: "WO",
    StepKind.SWAP_LAUNCH_LOAD: "LL",
    StepKind.SWAP_WAIT_LOAD: "WL",
    StepKind.TIED_GRAD_SUM: "TS",
    StepKind.RECOMPUTE: "R",
}


@dataclass(frozen=True, slots=True)
class MetaStep:
    """One step of a rank's order. Frozen and hashable; compare by value."""

    kind: StepKind
    stage: int
    micro: int
    peer: int | None = None
    sub_steps: tuple[MetaStep, ...] = ()

    def __post_init__(self) -> None:
        # Hot path (the scheduler builds hundreds of thousands of steps): exact-type checks
        # first, the general isinstance checks only when those fail; kind roles by value
        # (a str hash) rather than by the Enum's Python-level __hash__.
        kind = self.kind
        if type(kind) is not StepKind:
            raise TypeError(f"MetaStep.kind must be a StepKind, got {kind!r}")
        if type(self.stage) is not int or type(self.micro) is not int:
            for name in ("stage", "micro"):
                value = getattr(self, name)
                if not isinstance(value, int) or isinstance(value, bool):
                    raise TypeError(f"MetaStep.{name} must be an int, got {value!r}")
        peer = self.peer
        if (
            peer is not None
            and not (type(peer) is int and peer >= 0)
            and (not isinstance(peer, int) or peer < 0)
        ):
            raise TypeError(f"MetaStep.peer must be None or an int >= 0, got {peer!r}")
        value = kind._value_
        if peer is None and value in _P2P_VALUES:
            raise ValueError(f"{value} needs a peer rank")
        is_container = value in _CONTAINER_VALUES
        if is_container and not self.sub_steps:
            raise ValueError(f"{value} needs sub_steps")
        if not is_container and self.sub_steps:
            raise ValueError(f"{value} cannot hold sub_steps")

    # -- classification -------------------------------------------------------------
    @property
    def is_compute(self) -> bool:
        """A compute slot: a compute leaf or a composite (one slot for both leaves)."""
        return self.kind in COMPUTE_KINDS or self.kind in COMPOSITE_KINDS

    @property
    def is_comm(self) -> bool:
        """Communication: a P2P step, a BATCH_SEND_RECV container or an FSDP action."""
        return (
            self.kind in P2P_KINDS
            or self.kind is StepKind.BATCH_SEND_RECV
            or self.kind in FSDP_KINDS
            or self.kind is StepKind.TIED_GRAD_SUM
        )

    @property
    def is_swap(self) -> bool:
        return self.kind in SWAP_KINDS

    @property
    def chunk(self) -> tuple[int, int]:
        """The logical chunk key ``(stage, micro)``."""
        return (self.stage, self.micro)

    # -- text and JSON ---------------------------------------------------------------
    def short(self) -> str:
        """Compact text for grids: ``F3.0`` is FWD of micro 3 on stage 0."""
        if self.sub_steps:
            inner = "+".join(s.short() for s in self.sub_steps)
            return f"{_SHORT[self.kind]}[{inner}]"
        if self.kind in FSDP_KINDS or self.kind is StepKind.TIED_GRAD_SUM:
            return f"{_SHORT[self.kind]}.s{self.stage}"
        return f"{_SHORT[self.kind]}{self.micro}.{self.stage}"

    def __str__(self) -> str:
        return self.short()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind.value, "stage": self.stage, "micro": self.micro}
        if self.peer is not None:
            out["peer"] = self.peer
        if self.sub_steps:
            out["sub_steps"] = [s.to_dict() for s in self.sub_steps]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> MetaStep:
        try:
            kind = StepKind(data["kind"])
        except (KeyError, ValueError) as exc:
            raise ValueError(f"MetaStep.from_dict: bad or missing 'kind' in {data!r}") from exc
        return cls(
            kind=kind,
            stage=data["stage"],
            micro=data["micro"],
            peer=data.get("peer"),
            sub_steps=tuple(cls.from_dict(s) for s in data.get("sub_steps", ())),
        )


Order = tuple[MetaStep, ...]

_new_object = object.__new__
_SET_KIND = MetaStep.__dict__["kind"].__set__
_SET_STAGE = MetaStep.__dict__["stage"].__set__
_SET_MICRO = MetaStep.__dict__["micro"].__set__
_SET_PEER = MetaStep.__dict__["peer"].__set__
_SET_SUB_STEPS = MetaStep.__dict__["sub_steps"].__set__


def trusted_step(
    kind: StepKind,
    stage: int,
    micro: int,
    peer: int | None = None,
    sub_steps: tuple[MetaStep, ...] = (),
) -> MetaStep:
    """Build a MetaStep WITHOUT the ``__post_init__`` checks (about twice as fast).

    Only for the scheduler's hot loops (lowering builds ~10^5 steps for pp=32), whose
    fields are right by construction: kinds are StepKind constants, stage/micro/peer are
    ints computed from a validated ScheduleConfig, P2P steps always get a peer and
    containers non-empty sub_steps. The result is an ordinary MetaStep (equal to and
    hashing like the checked one). Anything built from outside input must use
    ``MetaStep(...)``.
    """
    step: MetaStep = _new_object(MetaStep)
    _SET_KIND(step, kind)
    _SET_STAGE(step, stage)
    _SET_MICRO(step, micro)
    _SET_PEER(step, peer)
    _SET_SUB_STEPS(step, sub_steps)
    return step


def iter_leaves(order: Order) -> Iterator[MetaStep]:
    """Every non-container step, depth first, in order (composites and batches expanded)."""
    for step in order:
        if step.sub_steps:
            yield from iter_leaves(step.sub_steps)
        else:
            yield step
