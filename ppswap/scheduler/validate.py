"""Validation of orders: per-rank invariants, cross-rank P2P pairing, progress simulation.

``validate_order``
    One rank's invariants. Every step names a stage of the rank; every chunk
    ``(stage, micro)`` of the rank has exactly one FWD and, unless forward-only, exactly
    one BWD or one BWD_INPUT + one BWD_WEIGHT (the split only where
    ``config.splits_backward``: with ``split_dw`` never on stage 0; the zero-bubble
    families and a given order split any stage); FWD comes in an earlier compute slot
    than its backward, BWD_INPUT in an earlier one than its BWD_WEIGHT; composites are
    ``OVERLAP_B_F(BWD|BWD_INPUT, FWD)`` or ``OVERLAP_F_B(FWD, BWD|BWD_INPUT)`` and exist
    only where ``config.has_composites``. With ``lowered=True`` (the default: a finalized
    order) also: the P2P steps between two compute slots are exactly the sends of the
    earlier slot and the recvs of the later one, derived from the compute slots and the
    stage -> rank placement (``analysis.expected_p2p``, not lowering's code); in batch
    mode consecutive P2P steps are fused into one BATCH_SEND_RECV (two or more steps; a
    lone step is bare), in the other modes there is no BATCH_SEND_RECV; FSDP steps only with
    ``fsdp``, and every compute leaf runs while its stage is unsharded (UNSHARD and
    RESHARD alternate per stage, starting and ending sharded); swap steps only with
    ``swap`` and at top level; a RECOMPUTE at most once per chunk, at top level, after
    the chunk's FWD and before its BWD / BWD_INPUT (never in a forward-only order), with
    FSDP while its stage is unsharded. ``lowered=False`` checks a compute order (compute
    slots only).
``validate_p2p_pairs``
    Across ranks: every send has its receive and the other way round, with matching
    peers, and on each channel ``(src rank, dst rank, F|B)`` the sends and the receives
    come in the same order (so FIFO transports and tag-matching transports both work).
``simulate_progress``
    Plays every rank's order. Sends never block; a RECV blocks until its matching SEND
    has executed (a RECV is placed directly before its consumer, so this is the moment
    the consumer awaits it); a BATCH_SEND_RECV posts all its sends, then waits for all
    its recvs. Compute, FSDP and swap steps are local and never block. If every
    unfinished rank is blocked, it raises ``ScheduleDeadlockError`` whose message shows
    each rank's order around the step where it is stuck (marked ``>>``).
``validate_all``
    All of the above on a full set of finalized orders.

All errors are ``ScheduleValidationError`` (a ValueError); the deadlock error is a
subclass of it. Each rule is a module of its own: ``validate_steps`` (kinds, placement,
chunks), ``validate_p2p`` (the gaps, batch runs and the pairing across ranks),
``validate_lifecycles`` (FSDP states, RECOMPUTE), ``validate_progress`` (the simulation);
this module runs them.
"""

from __future__ import annotations

from collections.abc import Sequence

from ppswap.scheduler.analysis import check_orders
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.schedules import check_rank
from ppswap.scheduler.steps import Order
from ppswap.scheduler.validate_errors import ScheduleDeadlockError, ScheduleValidationError
from ppswap.scheduler.validate_lifecycles import check_fsdp_states, check_recompute
from ppswap.scheduler.validate_p2p import check_batch_runs, check_p2p_gaps, validate_p2p_pairs
from ppswap.scheduler.validate_progress import simulate_progress
from ppswap.scheduler.validate_steps import check_chunks, check_steps

__all__ = [
    "ScheduleDeadlockError",
    "ScheduleValidationError",
    "simulate_progress",
    "validate_all",
    "validate_order",
    "validate_p2p_pairs",
]


def validate_order(
    config: ScheduleConfig, rank: int, order: Order, *, lowered: bool = True
) -> None:
    """Check one rank's order (module docstring); raise ScheduleValidationError."""
    check_rank(config, rank)
    if not isinstance(order, tuple):
        raise TypeError(f"order must be a tuple of MetaStep, got {type(order).__name__}")
    check_steps(config, rank, order, lowered)
    check_chunks(config, rank, order)
    if lowered:
        check_recompute(config, rank, order)
        check_p2p_gaps(config, rank, order)
        if config.p2p == "batch":
            check_batch_runs(rank, order)
        if config.fsdp:
            check_fsdp_states(rank, order)


def validate_all(config: ScheduleConfig, orders: Sequence[Order]) -> None:
    """Every per-rank check, the cross-rank pairing and the progress simulation."""
    check_orders(config, orders)
    for rank, order in enumerate(orders):
        validate_order(config, rank, order)
    validate_p2p_pairs(config, orders)
    simulate_progress(config, orders)
