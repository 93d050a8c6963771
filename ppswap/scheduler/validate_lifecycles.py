"""What happens to a stage or a chunk between steps, in order: a stage's FSDP
UNSHARD / RESHARD alternate and bracket its compute; a chunk's RECOMPUTE comes once,
between its FWD and its backward (module docstring of ``ppswap.scheduler.validate``)."""

from __future__ import annotations

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import BWD_WEIGHT, CONSUMER_KINDS, FWD, RECOMPUTE, Order, StepKind
from ppswap.scheduler.validate_errors import ScheduleValidationError
from ppswap.scheduler.validate_steps import leaves_of

__all__ = ["check_fsdp_states", "check_recompute"]


def check_fsdp_states(rank: int, order: Order) -> None:
    """Per stage, FSDP_UNSHARD and FSDP_RESHARD alternate, starting and ending sharded,
    and every compute leaf and RECOMPUTE runs while its stage is unsharded."""
    unsharded: set[int] = set()
    for index, step in enumerate(order):
        kind = step.kind
        if kind is StepKind.FSDP_UNSHARD:
            if step.stage in unsharded:
                raise ScheduleValidationError(
                    f"rank {rank} step {index}: FSDP_UNSHARD of stage {step.stage} while "
                    "it is already unsharded"
                )
            unsharded.add(step.stage)
        elif kind is StepKind.FSDP_RESHARD:
            if step.stage not in unsharded:
                raise ScheduleValidationError(
                    f"rank {rank} step {index}: FSDP_RESHARD of stage {step.stage} while "
                    "it is sharded"
                )
            unsharded.discard(step.stage)
        elif step.is_compute or kind is RECOMPUTE:
            for leaf in leaves_of(step):
                if leaf.stage not in unsharded:
                    raise ScheduleValidationError(
                        f"rank {rank} step {index} ({leaf.short()}): stage {leaf.stage} "
                        "runs while its parameters are sharded (no FSDP_UNSHARD before it)"
                    )
    if unsharded:
        raise ScheduleValidationError(
            f"rank {rank}: stages {sorted(unsharded)} are still unsharded at the end "
            "(missing FSDP_RESHARD)"
        )


def check_recompute(config: ScheduleConfig, rank: int, order: Order) -> None:
    """Each RECOMPUTE: one per chunk, after the chunk's FWD, before its BWD/BWD_INPUT."""
    fwd_seen: set[tuple[int, int]] = set()
    pending: dict[tuple[int, int], int] = {}
    done: set[tuple[int, int]] = set()
    for index, step in enumerate(order):
        if step.kind is RECOMPUTE:
            where = f"rank {rank} step {index} ({step.short()})"
            if config.forward_only:
                raise ScheduleValidationError(f"{where}: a forward-only order recomputes nothing")
            if step.chunk in pending or step.chunk in done:
                raise ScheduleValidationError(f"{where}: a chunk is recomputed at most once")
            if step.chunk not in fwd_seen:
                raise ScheduleValidationError(f"{where}: RECOMPUTE before the chunk's FWD")
            pending[step.chunk] = index
            continue
        for leaf in leaves_of(step):
            if leaf.kind is FWD:
                fwd_seen.add(leaf.chunk)
            elif leaf.kind in CONSUMER_KINDS and leaf.chunk in pending:
                del pending[leaf.chunk]
                done.add(leaf.chunk)
            elif leaf.kind is BWD_WEIGHT and leaf.chunk in pending:
                raise ScheduleValidationError(
                    f"rank {rank} step {pending[leaf.chunk]}: RECOMPUTE of chunk {leaf.chunk} "
                    "comes after its BWD_INPUT (BWD_WEIGHT never recomputes)"
                )
    if pending:
        chunk, index = next(iter(pending.items()))
        raise ScheduleValidationError(
            f"rank {rank} step {index}: RECOMPUTE of chunk {chunk} has no backward after it"
        )
