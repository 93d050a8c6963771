"""Compute orders of the V families: ZBV (zero bubble, V shape) and DualPipeV.

Both need ``vpp == 2`` and place the stages in a V (``families.v_rank_of``): rank ``r``
holds ``first = r`` (the down leg) and ``second = 2 * pp - 1 - r`` (the way back up). Both
give the same order, action for action, as torch.distributed.pipelining's
``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV``
(``tests/torch_backend/test_torch_new_orders.py`` compares them). Micro-batches count
up per stage and kind. ``m`` micro-batches, rank ``r``; ``F1`` is a forward of
``second``, ``I0`` a BWD_INPUT of ``first``, and so on.

ZBV (arXiv 2401.10241, section 6)
    Built for ``n = max(2 * pp - 1, m)`` micro-batches: ``2 (pp - r) - 1`` F0; ``r`` times
    F1 F0; ``pp - r`` times F1 I1 W1; then while a forward remains (F0 up to ``n``, F1 up
    to F0's count) [F0] I0 W0 F1 I1 W1; then ``r`` times I0 I1; ``pp - r`` times I0 W0
    (the weights of these run in backward order); the pending W1s, then the pending W0s.
    Every action of a micro-batch ``>= m`` is then dropped (ZBV's order for small ``m``).
DualPipeV (DeepSeek-V3, arXiv 2412.19437)
    ``m >= 2 * pp``. ``2 (pp - r - 1)`` F0; ``r + 1`` times F0 F1; ``pp - r - 1`` times
    I1 W F1; ``m - 2 pp + r + 1`` times OVERLAP(F0, B1) OVERLAP(F1, B0) (the very first
    pair of the last rank not overlapped: F0 then B1); ``pp - r - 1`` times B1
    OVERLAP(F1, B0); ``r + 1`` times B1 B0 where from the middle pair on (on an odd rank
    from its B1, on an even rank from its B0) each backward is split (BWD_INPUT); ``pp -
    r - 1`` times W B0 (B0 split if the split began); ``r + 1`` times W. Each W is the
    oldest pending weight of a BWD_INPUT (a FIFO over both stages); a W finding none is
    skipped. An OVERLAP(F, B) pair is one ``OVERLAP_F_B`` compute slot whose sub-steps are
    the FWD and the full BWD, in that order, run with real overlap by the runtime.
"""

from __future__ import annotations

from collections import deque

from ppswap.scheduler.families import v_stages_of
from ppswap.scheduler.steps import MetaStep, Order, StepKind, trusted_step

__all__ = ["dualpipev_order", "zbv_order"]

_FWD = StepKind.FWD
_BWD = StepKind.BWD
_BWD_INPUT = StepKind.BWD_INPUT
_BWD_WEIGHT = StepKind.BWD_WEIGHT
_OVERLAP_F_B = StepKind.OVERLAP_F_B


def zbv_order(pp: int, micro: int, rank: int) -> Order:
    """Rank ``rank``'s compute slots under ZBV (module docstring)."""
    first, second = v_stages_of(pp, rank)
    built = max(2 * pp - 1, micro)
    count: dict[tuple[StepKind, int], int] = {}
    out: list[MetaStep] = []

    def emit(kind: StepKind, stage: int) -> None:
        index = count.get((kind, stage), 0)
        count[kind, stage] = index + 1
        out.append(trusted_step(kind, stage, index))

    def done(kind: StepKind, stage: int) -> int:
        return count.get((kind, stage), 0)

    for _ in range(2 * (pp - rank) - 1):
        emit(_FWD, first)
    for _ in range(rank):
        emit(_FWD, second)
        emit(_FWD, first)
    for _ in range(pp - rank):
        emit(_FWD, second)
        emit(_BWD_INPUT, second)
        emit(_BWD_WEIGHT, second)
    while done(_FWD, second) < done(_FWD, first) or done(_FWD, first) < built:
        if done(_FWD, first) < built:
            emit(_FWD, first)
        emit(_BWD_INPUT, first)
        emit(_BWD_WEIGHT, first)
        emit(_FWD, second)
        emit(_BWD_INPUT, second)
        emit(_BWD_WEIGHT, second)
    for _ in range(rank):
        emit(_BWD_INPUT, first)
        emit(_BWD_INPUT, second)
    for _ in range(pp - rank):
        emit(_BWD_INPUT, first)
        emit(_BWD_WEIGHT, first)
    while done(_BWD_WEIGHT, second) < done(_BWD_INPUT, second):
        emit(_BWD_WEIGHT, second)
    while done(_BWD_WEIGHT, first) < done(_BWD_INPUT, first):
        emit(_BWD_WEIGHT, first)
    return tuple(step for step in out if step.micro < micro)


def dualpipev_order(pp: int, micro: int, rank: int) -> Order:
    """Rank ``rank``'s compute slots under DualPipeV (module docstring)."""
    first, second = v_stages_of(pp, rank)
    forwards = {first: 0, second: 0}
    backwards = {first: 0, second: 0}
    weights: deque[MetaStep] = deque()
    out: list[MetaStep] = []

    def forward(stage: int) -> MetaStep:
        forwards[stage] += 1
        return trusted_step(_FWD, stage, forwards[stage] - 1)

    def backward(stage: int, split: bool = False) -> MetaStep:
        backwards[stage] += 1
        micro_index = backwards[stage] - 1
        if split:
            weights.append(trusted_step(_BWD_WEIGHT, stage, micro_index))
        return trusted_step(_BWD_INPUT if split else _BWD, stage, micro_index)

    def overlap(forward_stage: int, backward_stage: int) -> MetaStep:
        fwd = forward(forward_stage)
        bwd = backward(backward_stage)
        return trusted_step(_OVERLAP_F_B, fwd.stage, fwd.micro, None, (fwd, bwd))

    def weight() -> None:
        if weights:
            out.append(weights.popleft())

    for _ in range(2 * (pp - rank - 1)):
        out.append(forward(first))
    for _ in range(rank + 1):
        out.append(forward(first))
        out.append(forward(second))
    for _ in range(pp - rank - 1):
        out.append(backward(second, split=True))
        weight()
        out.append(forward(second))
    for i in range(micro - 2 * pp + rank + 1):
        if i == 0 and rank == pp - 1:
            out.append(forward(first))
            out.append(backward(second))
        else:
            out.append(overlap(first, second))
        out.append(overlap(second, first))
    for _ in range(pp - rank - 1):
        out.append(backward(second))
        out.append(overlap(second, first))
    pairs = rank + 1
    split = False
    for i in range(pairs):
        if i == pairs // 2 and rank % 2 == 1:
            split = True
        out.append(backward(second, split))
        if i == pairs // 2 and rank % 2 == 0:
            split = True
        out.append(backward(first, split))
    for _ in range(pp - rank - 1):
        weight()
        out.append(backward(first, split))
    for _ in range(rank + 1):
        weight()
    return tuple(out)
