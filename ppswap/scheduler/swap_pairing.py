"""Pairing for the swap planner: one scan of a swap-free order (``pair_chunks``).

What ``swap_plan`` needs from a rank's order before it can place anything: the top-level
index of every compute slot, each chunk's FWD slot and consumer slot (BWD, or BWD_INPUT
with the dx/dw split) in FWD order, and, for consumers whose stage has FSDP steps, the
FSDP_UNSHARD that opens the consumer's use run. One pass, linear in the order: steps are
told apart by their kind's value (a str, whose hash is cached) or by identity, never by
hashing a StepKind member (``Enum.__hash__`` is a Python call).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import (
    BWD,
    BWD_INPUT,
    COMPUTE_KINDS,
    FSDP_RESHARD,
    FSDP_UNSHARD,
    FWD,
    OVERLAP_B_F,
    OVERLAP_F_B,
    SWAP_KINDS,
    MetaStep,
    Order,
    iter_leaves,
)

__all__ = ["Chunk", "SwapPairing", "pair_chunks"]

Chunk = tuple[int, int]


@dataclass(frozen=True, slots=True)
class SwapPairing:
    """What one scan of a swap-free order finds (``pair_chunks``).

    ``slot_index[k]`` is the top-level index of compute slot ``k``. ``chunks`` lists the
    chunks in FWD order, with ``fwd_slot`` / ``consumer_slot`` beside them. ``open_unshard``
    maps a chunk to the index of the FSDP_UNSHARD that opens its consumer's use run (the
    stage's last FSDP step before the consumer is that UNSHARD and no compute slot uses the
    stage in between); ``fsdp_stages`` are the stages with any FSDP step.
    """

    slot_index: list[int]
    chunks: list[Chunk]
    fwd_slot: list[int]
    consumer_slot: list[int]
    open_unshard: dict[Chunk, int]
    fsdp_stages: frozenset[int]


_LEAF, _COMPOSITE, _UNSHARD_ROLE, _RESHARD_ROLE, _SWAP_ROLE = range(5)
_ROLE_OF_VALUE: dict[str, int] = {
    **{kind.value: _LEAF for kind in COMPUTE_KINDS},
    OVERLAP_B_F.value: _COMPOSITE,
    OVERLAP_F_B.value: _COMPOSITE,
    FSDP_UNSHARD.value: _UNSHARD_ROLE,
    FSDP_RESHARD.value: _RESHARD_ROLE,
    **{kind.value: _SWAP_ROLE for kind in SWAP_KINDS},
}
"""What ``pair_chunks`` does with a step, by its kind's value (a str: its hash is cached, an
Enum member's ``__hash__`` is a Python call); P2P steps and containers are absent."""


def pair_chunks(order: Order, config: ScheduleConfig, rank: int | None) -> SwapPairing:
    """Scan a swap-free ``order`` once: its compute slots, each chunk's FWD and consumer
    slot, the FSDP unshards that open consumers' use runs. With ``rank``, refuse leaves of
    another rank's stages. Raises ValueError for the faults ``swap_plan.plan_swap`` names."""
    rank_of = config.rank_of
    fwd, bwd, bwd_input = FWD, BWD, BWD_INPUT
    role_of = _ROLE_OF_VALUE.get
    slot_index: list[int] = []
    fwd_of: dict[Chunk, int] = {}
    consumer_of: dict[Chunk, int] = {}
    open_unshard: dict[Chunk, int] = {}
    unshard_at: dict[int, int] = {}  # stage -> its UNSHARD, while that is its last event
    fsdp_stages: set[int] = set()
    swap_steps = 0
    shared_fwd_slot = False
    single: list[MetaStep] = [order[0]] if order else []  # reused: no tuple per leaf slot
    leaves: Sequence[MetaStep]
    for index, step in enumerate(order):
        role = role_of(step.kind._value_)
        if role is None:
            continue
        if role == _LEAF:
            single[0] = step
            leaves = single
        elif role == _COMPOSITE:
            leaves = [leaf for leaf in iter_leaves((step,)) if leaf.kind in COMPUTE_KINDS]
            shared_fwd_slot |= sum(leaf.kind is fwd for leaf in leaves) > 1
        else:
            if role == _UNSHARD_ROLE:
                unshard_at[step.stage] = index
                fsdp_stages.add(step.stage)
            elif role == _RESHARD_ROLE:
                unshard_at.pop(step.stage, None)
                fsdp_stages.add(step.stage)
            else:
                swap_steps += 1
            continue
        slot = len(slot_index)
        slot_index.append(index)
        for leaf in leaves:
            stage = leaf.stage
            if rank is not None and rank_of(stage) != rank:
                raise ValueError(
                    f"order for rank {rank} holds {leaf.short()} of stage {stage}, "
                    f"which lives on rank {config.rank_of(stage)}"
                )
            leaf_kind = leaf.kind
            if leaf_kind is fwd:
                table = fwd_of
            elif leaf_kind is bwd or leaf_kind is bwd_input:
                table = consumer_of
                opener = unshard_at.get(stage)
                if opener is not None:
                    open_unshard[(stage, leaf.micro)] = opener
            else:
                continue
            chunk = (stage, leaf.micro)
            if chunk in table:
                raise ValueError(
                    f"order holds two {leaf_kind.value} steps for chunk (stage, micro) = "
                    f"{chunk}; each chunk needs exactly one"
                )
            table[chunk] = slot
        if unshard_at:  # a use: the stages' parameters are unsharded from here on
            for leaf in leaves:
                unshard_at.pop(leaf.stage, None)
    if swap_steps:
        raise ValueError(
            "order must not hold swap steps already (strip_swap_steps(order) first), "
            f"got {swap_steps} swap steps"
        )
    for chunk in consumer_of:
        if chunk not in fwd_of:
            raise ValueError(f"chunk (stage, micro) = {chunk} has a backward but no FWD")
    ordered = list(fwd_of.items())
    if shared_fwd_slot:  # two FWDs in one composite: by chunk within the slot
        ordered.sort(key=lambda item: (item[1], item[0]))
    consumer_slot: list[int] = []
    for chunk, f in ordered:
        c = consumer_of.get(chunk)
        if c is None:
            raise ValueError(
                f"chunk (stage, micro) = {chunk} has a FWD but no BWD/BWD_INPUT consumer; "
                "swap needs a backward for every forward"
            )
        if c < f:
            raise ValueError(
                f"chunk (stage, micro) = {chunk}: its consumer (slot {c}) comes before its "
                f"FWD (slot {f})"
            )
        consumer_slot.append(c)
    return SwapPairing(
        slot_index=slot_index,
        chunks=[chunk for chunk, _ in ordered],
        fwd_slot=[f for _, f in ordered],
        consumer_slot=consumer_slot,
        open_unshard=open_unshard,
        fsdp_stages=frozenset(fsdp_stages),
    )
