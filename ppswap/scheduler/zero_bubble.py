"""Compute orders of the looped families: Looped BFS and Interleaved Zero Bubble (ZB1P).

Both place stage ``s`` on rank ``s % pp`` (rank ``r`` holds stages ``r + c * pp`` for its
chunks ``c = 0 .. vpp - 1``) and give the same order, action for action, as
torch.distributed.pipelining's ``ScheduleLoopedBFS`` and ``ScheduleInterleavedZeroBubble``
(``tests/torch_backend/test_torch_new_orders.py`` compares them). ``m`` is the number of
micro-batches, ``r`` the rank.

Looped BFS (breadth first, arXiv 2211.05953)
    For each chunk in turn, the forwards of every micro-batch; then for each chunk from the
    last to the first, the full backwards (BWD) of every micro-batch, the last micro-batch
    first.
Interleaved Zero Bubble (ZB1P, arXiv 2401.10241)
    The interleaved 1F1B order of torch with micro-batches in ``rounds = max(1, m // pp)``
    rounds of ``per_round = m // rounds``, a warm-up of
    ``w = min((vpp - 1) * per_round + (pp - 1 - r), m * vpp)`` forwards (one per hop from
    the last rank, where interleaved 1F1B has two), every backward split into BWD_INPUT
    and BWD_WEIGHT (stage 0 included), and the weights deferred: backward ``k`` is
    followed by the weight of backward ``k - r`` once ``k >= r`` (``r`` weights pending),
    and the ``r`` pending weights close the order. Forward op ``k`` runs chunk
    ``(k // per_round) % vpp``, backward op ``k`` chunk
    ``vpp - 1 - ((k - w) // per_round) % vpp``; micro-batches count up per stage.
"""

from __future__ import annotations

from collections import deque

from ppswap.scheduler.families import rounds_of
from ppswap.scheduler.steps import MetaStep, Order, StepKind, trusted_step

__all__ = ["interleaved_zb_order", "looped_bfs_order", "zb_warmup_count"]

_FWD = StepKind.FWD
_BWD = StepKind.BWD
_BWD_INPUT = StepKind.BWD_INPUT
_BWD_WEIGHT = StepKind.BWD_WEIGHT


def looped_bfs_order(pp: int, vpp: int, micro: int, rank: int) -> Order:
    """Rank ``rank``'s compute slots under Looped BFS (module docstring)."""
    stages = [rank + chunk * pp for chunk in range(vpp)]
    forwards = [trusted_step(_FWD, stage, i) for stage in stages for i in range(micro)]
    backwards = [
        trusted_step(_BWD, stage, i) for stage in reversed(stages) for i in reversed(range(micro))
    ]
    return (*forwards, *backwards)


def zb_warmup_count(pp: int, vpp: int, micro: int, rank: int) -> int:
    """Forwards before the first backward in Interleaved Zero Bubble (module docstring)."""
    per_round = micro // rounds_of(pp, micro)
    return min((vpp - 1) * per_round + (pp - 1 - rank), micro * vpp)


def interleaved_zb_order(pp: int, vpp: int, micro: int, rank: int) -> Order:
    """Rank ``rank``'s compute slots under Interleaved Zero Bubble (module docstring)."""
    per_round = micro // rounds_of(pp, micro)
    warmup = zb_warmup_count(pp, vpp, micro, rank)
    total = micro * vpp
    next_micro: dict[tuple[StepKind, int], int] = {}

    def step(kind: StepKind, stage: int) -> MetaStep:
        index = next_micro.get((kind, stage), 0)
        next_micro[kind, stage] = index + 1
        return trusted_step(kind, stage, index)

    def forward_stage(op: int) -> int:
        return ((op // per_round) % vpp) * pp + rank

    def backward_stage(op: int) -> int:
        return (vpp - 1 - ((op - warmup) // per_round) % vpp) * pp + rank

    out: list[MetaStep] = [step(_FWD, forward_stage(op)) for op in range(warmup)]
    pending: deque[int] = deque()  # stages of backwards whose weight is still to run
    for op in range(warmup, warmup + total):
        if op < total:  # steady state: one forward, one backward
            out.append(step(_FWD, forward_stage(op)))
        stage = backward_stage(op)
        out.append(step(_BWD_INPUT, stage))
        pending.append(stage)
        if op - warmup >= rank:
            out.append(step(_BWD_WEIGHT, pending.popleft()))
    out.extend(step(_BWD_WEIGHT, stage) for stage in pending)
    return tuple(out)
