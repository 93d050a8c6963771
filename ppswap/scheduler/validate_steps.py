"""One rank's steps and chunks: which kinds may stand where, on which stage and micro-batch,
and each chunk's FWD and backward (``validate_order``'s first rules, module docstring of
``ppswap.scheduler.validate``)."""

from __future__ import annotations

from collections.abc import Sequence

from ppswap.scheduler.analysis import compute_slots
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import (
    BATCH_SEND_RECV,
    BWD,
    BWD_INPUT,
    BWD_WEIGHT,
    COMPOSITE_KINDS,
    COMPUTE_KINDS,
    CONSUMER_KINDS,
    FSDP_KINDS,
    FWD,
    P2P_KINDS,
    SWAP_KINDS,
    MetaStep,
    Order,
    StepKind,
)
from ppswap.scheduler.validate_errors import ScheduleValidationError

__all__ = ["check_chunks", "check_steps", "leaves_of"]


def leaves_of(step: MetaStep) -> tuple[MetaStep, ...]:
    """A composite's or a batch's sub-steps; any other step alone."""
    return step.sub_steps if step.sub_steps else (step,)


def check_steps(config: ScheduleConfig, rank: int, order: Sequence[object], lowered: bool) -> None:
    """Every step of ``order`` is a MetaStep (else TypeError) of an allowed kind and shape,
    on a stage of ``rank`` with a micro-batch of the run (else ScheduleValidationError).
    ``lowered``: a finalized order (P2P, FSDP and swap steps allowed), else a compute order."""
    own_stages = frozenset(config.stages_of(rank))
    for index, step in enumerate(order):
        if not isinstance(step, MetaStep):
            raise TypeError(f"order[{index}] must be a MetaStep, got {step!r}")
        _check_shape(config, rank, index, step, lowered)
        _check_placement(config, rank, index, step, own_stages)


def _check_shape(
    config: ScheduleConfig, rank: int, index: int, step: MetaStep, lowered: bool
) -> None:
    """Allowed kinds at top level and the shape of containers and composites."""
    kind = step.kind
    where = f"rank {rank} step {index} ({step.short()})"
    if kind in COMPOSITE_KINDS:
        if not config.has_composites:
            raise ScheduleValidationError(f"{where}: composites need overlap_b_f=True")
        subs = [sub.kind for sub in step.sub_steps]
        if kind is StepKind.OVERLAP_F_B:
            subs.reverse()  # OVERLAP_F_B(FWD, backward): the same pair, forward first
        if len(subs) != 2 or subs[0] not in CONSUMER_KINDS or subs[1] is not FWD:
            raise ScheduleValidationError(
                f"{where}: a composite must be OVERLAP_B_F(BWD or BWD_INPUT, FWD) or "
                "OVERLAP_F_B(FWD, BWD or BWD_INPUT)"
            )
        return
    if kind in COMPUTE_KINDS:
        return
    if not lowered:
        raise ScheduleValidationError(
            f"{where}: a compute order holds compute slots only, got {kind.value}"
        )
    if kind is BATCH_SEND_RECV:
        if config.p2p != "batch":
            raise ScheduleValidationError(
                f"{where}: BATCH_SEND_RECV only with p2p='batch', got p2p={config.p2p!r}"
            )
        if len(step.sub_steps) < 2:
            raise ScheduleValidationError(
                f"{where}: a BATCH_SEND_RECV fuses two or more P2P steps (a lone step stays bare)"
            )
        for sub in step.sub_steps:
            if sub.kind not in P2P_KINDS:
                raise ScheduleValidationError(
                    f"{where}: BATCH_SEND_RECV holds P2P steps only, got {sub.kind.value}"
                )
    elif kind in FSDP_KINDS:
        if not config.fsdp:
            raise ScheduleValidationError(f"{where}: FSDP steps need fsdp=True")
    elif kind in SWAP_KINDS and not config.swap:
        raise ScheduleValidationError(f"{where}: swap steps need swap=True")


def _check_placement(
    config: ScheduleConfig, rank: int, index: int, step: MetaStep, own_stages: frozenset[int]
) -> None:
    for leaf in leaves_of(step):
        if leaf.stage not in own_stages:
            raise ScheduleValidationError(
                f"rank {rank} step {index} ({leaf.short()}): stage {leaf.stage} is not on "
                f"rank {rank} (its stages are {sorted(own_stages)})"
            )
        if leaf.kind in FSDP_KINDS:
            if leaf.micro != -1:
                raise ScheduleValidationError(
                    f"rank {rank} step {index}: FSDP steps have micro -1, got {leaf.micro}"
                )
        elif not 0 <= leaf.micro < config.micro:
            raise ScheduleValidationError(
                f"rank {rank} step {index} ({leaf.short()}): micro must be in "
                f"0..{config.micro - 1}, got {leaf.micro}"
            )


def check_chunks(config: ScheduleConfig, rank: int, order: Order) -> None:
    """Exactly one FWD and one backward (BWD, or BWD_INPUT + BWD_WEIGHT) per chunk."""
    slots: dict[StepKind, dict[tuple[int, int], int]] = {
        FWD: {},
        BWD: {},
        BWD_INPUT: {},
        BWD_WEIGHT: {},
    }
    for slot in compute_slots(order):
        for leaf in slot.leaves:
            seen = slots[leaf.kind]
            if leaf.chunk in seen:
                raise ScheduleValidationError(
                    f"rank {rank}: {leaf.kind.value} of chunk (stage {leaf.stage}, micro "
                    f"{leaf.micro}) appears twice (compute slots {seen[leaf.chunk]} and "
                    f"{slot.slot})"
                )
            seen[leaf.chunk] = slot.slot
    split_seen = slots[BWD_INPUT] or slots[BWD_WEIGHT]
    if config.forward_only and (slots[BWD] or split_seen):
        raise ScheduleValidationError(f"rank {rank}: a forward-only order has FWDs only")
    if split_seen and not config.splits_backward:
        raise ScheduleValidationError(f"rank {rank}: BWD_INPUT/BWD_WEIGHT need split_dw=True")
    for stage in config.stages_of(rank):
        for micro in range(config.micro):
            chunk = (stage, micro)
            where = f"rank {rank} chunk (stage {stage}, micro {micro})"
            fwd = slots[FWD].get(chunk)
            if fwd is None:
                raise ScheduleValidationError(f"{where}: no FWD")
            if config.forward_only:
                continue
            bwd = slots[BWD].get(chunk)
            first = slots[BWD_INPUT].get(chunk)
            weight = slots[BWD_WEIGHT].get(chunk)
            if bwd is not None and (first is not None or weight is not None):
                raise ScheduleValidationError(f"{where}: both BWD and BWD_INPUT/BWD_WEIGHT")
            if bwd is None and (first is None or weight is None):
                raise ScheduleValidationError(
                    f"{where}: needs one BWD, or one BWD_INPUT and one BWD_WEIGHT"
                )
            if stage == 0 and bwd is None and config.split_dw:
                raise ScheduleValidationError(f"{where}: stage 0 keeps a unified BWD")
            consumer = bwd if bwd is not None else first
            assert consumer is not None
            if not fwd < consumer:
                raise ScheduleValidationError(
                    f"{where}: FWD (compute slot {fwd}) must come before its backward "
                    f"(compute slot {consumer})"
                )
            if weight is not None and not consumer < weight:
                raise ScheduleValidationError(
                    f"{where}: BWD_INPUT (compute slot {consumer}) must come before "
                    f"BWD_WEIGHT (compute slot {weight})"
                )
