"""Compute orders: which compute slot a rank runs when, for every schedule family.

``compute_order(config, rank)`` returns a rank's order of *compute slots only*: FWD, BWD,
BWD_INPUT, BWD_WEIGHT leaves and OVERLAP_B_F composites. Communication (P2P, FSDP) and
swap steps are added later by the lowering passes (``ppswap.scheduler.lowering``).

Families (``m`` micro-batches, ``r`` the rank, stage ``s`` on rank
``s % pp``):

GPipe
    All FWD in micro order, then all BWD in micro order.
1F1B
    Megatron-LM's non-interleaved order (PipeDream-flush): ``w = min(pp - r - 1, m)``
    warm-up forwards, then ``m - w`` steady iterations "FWD(w + k), BWD(k)", then the
    ``w`` remaining backwards (cool-down).
Interleaved 1F1B
    Megatron-LM's interleaved order with ``vpp`` virtual stages per rank (model chunk ``c``
    of rank ``r`` is global stage ``c * pp + r``). The ``m * vpp`` virtual micro-batches
    run in Megatron's schedule table: micro-batches in groups of ``pp``, and inside a
    group every chunk in turn (``get_model_chunk_id``: chunk ``(k % (pp * vpp)) // pp``,
    micro ``(k // (pp * vpp)) * pp + k % pp``). The backward of virtual micro-batch ``k``
    uses the same table with the chunk reversed (``vpp - 1 - c``): the backward goes
    through the virtual stages in reverse. Warm-up
    ``w = min((pp - r - 1) * 2 + (vpp - 1) * pp, m * vpp)``; steady iterations and
    cool-down as in 1F1B. ``m % pp == 0`` is required (ScheduleConfig refuses otherwise).

Options:

forward_only
    Only FWDs, in the family's forward order (Megatron's all-warm-up forward-only pass).
split_dw (dx/dw split, ZB-H1 style)
    Every backward of a stage other than stage 0 becomes BWD_INPUT (the activation
    consumer; it sends dx) plus a later BWD_WEIGHT. Stage 0 keeps a unified BWD (it has
    no dx to send, so splitting buys nothing). The BWD_WEIGHTs of standalone BWD_INPUTs
    are deferred in a FIFO with a per-rank lag ``L`` (``weight_lag``): after each
    backward slot, while more than ``L`` weights are pending, the oldest is emitted; the
    rest fill the cool-down at the end. ``L = r`` for gpipe and 1f1b, ``L = 2 r`` for
    interleaved, which is exactly rank 0's extra warm-up over rank ``r`` (``w_0 - w_r``
    for large ``m``): rank ``r`` has that many fewer chunks in flight than rank 0 and
    that many more slots of trailing bubble, so the deferred weights fill the bubble
    while the activation memory stays within rank 0's (the 1F1B peak): ZB-H1.
overlap_b_f (real overlap)
    Wherever the family's order runs a backward immediately followed by a forward (the
    steady state of 1F1B and interleaved 1F1B: "BWD(k)" of one iteration then
    "FWD(w + k + 1)" of the next), the pair becomes ONE compute slot
    ``OVERLAP_B_F(sub_steps=(BWD_i or BWD_INPUT_i, FWD_j))``. The two leaves are always
    different chunks, so they are independent. With split_dw the composite holds
    BWD_INPUT_i and its BWD_WEIGHT_i is the very next compute slot (after the dx send
    once lowered); it does not enter the lag FIFO. Backwards not followed by a forward
    (the cool-down) stay standalone.

Decisions where the design was silent:

- GPipe + overlap_b_f is refused by ScheduleConfig: GPipe has no steady state (no
  backward is ever followed by a forward), so the flag could only be silently ignored.
- micro < pp: gpipe and 1f1b give a correct order (the warm-up is capped at ``m``; the
  cross-rank simulation proves progress). Interleaved needs ``m % pp == 0``, so it
  never sees ``m < pp`` (refused by ScheduleConfig).
- An order with 1F1B and ``m == 1`` has no steady pair, hence no composite.

Looped BFS, Interleaved Zero Bubble, ZBV and DualPipeV are built by
``ppswap.scheduler.zero_bubble`` and ``ppswap.scheduler.v_schedules`` (torch's orders,
action for action); a given order (``config.order``) is returned as it is. Forward-only,
any of these is its forwards in the same order (a composite gives its FWD).
"""

from __future__ import annotations

from collections import deque

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.families import FAMILIES
from ppswap.scheduler.steps import MetaStep, Order, StepKind, iter_leaves, trusted_step
from ppswap.scheduler.v_schedules import dualpipev_order, zbv_order
from ppswap.scheduler.zero_bubble import interleaved_zb_order, looped_bfs_order

__all__ = [
    "backward_chunks",
    "check_rank",
    "compute_order",
    "forward_chunks",
    "warmup_count",
    "weight_lag",
]

_FWD = StepKind.FWD
_BWD = StepKind.BWD
_BWD_INPUT = StepKind.BWD_INPUT
_BWD_WEIGHT = StepKind.BWD_WEIGHT
_OVERLAP_B_F = StepKind.OVERLAP_B_F


def check_rank(config: ScheduleConfig, rank: int) -> None:
    """Raise TypeError/ValueError unless ``rank`` is an int in ``0 .. config.pp - 1``."""
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise TypeError(f"rank must be an int in 0..{config.pp - 1}, got {rank!r}")
    if not 0 <= rank < config.pp:
        raise ValueError(f"rank must be an int in 0..{config.pp - 1}, got {rank!r}")


def _schedule_table(config: ScheduleConfig) -> list[tuple[int, int]]:
    """Megatron's interleaved schedule table: virtual micro-batch k -> (micro, chunk)."""
    pp, vpp, m = config.pp, config.vpp, config.micro
    table: list[tuple[int, int]] = []
    for group_start in range(0, m, pp):
        group = range(group_start, min(group_start + pp, m))
        for chunk in range(vpp):
            table.extend((micro, chunk) for micro in group)
    return table


def _leaf_chunks(
    config: ScheduleConfig, rank: int, kinds: frozenset[StepKind]
) -> tuple[tuple[int, int], ...]:
    leaves = iter_leaves(compute_order(config, rank))
    return tuple(leaf.chunk for leaf in leaves if leaf.kind in kinds)


def forward_chunks(config: ScheduleConfig, rank: int) -> tuple[tuple[int, int], ...]:
    """The ``(stage, micro)`` chunks of the rank's forwards, in execution order."""
    check_rank(config, rank)
    if config.order is not None or config.schedule in FAMILIES:
        return _leaf_chunks(config, rank, frozenset({_FWD}))
    if config.schedule != "interleaved_1f1b":
        return tuple((rank, micro) for micro in range(config.micro))
    pp = config.pp
    return tuple((chunk * pp + rank, micro) for micro, chunk in _schedule_table(config))


def backward_chunks(config: ScheduleConfig, rank: int) -> tuple[tuple[int, int], ...]:
    """The ``(stage, micro)`` chunks of the rank's backwards, in execution order.

    Empty for a forward-only config. Interleaved: the forward table with the chunk
    reversed, so the backward walks the virtual stages from the last to the first.
    """
    check_rank(config, rank)
    if config.forward_only:
        return ()
    if config.order is not None or config.schedule in FAMILIES:
        return _leaf_chunks(config, rank, frozenset({_BWD, _BWD_INPUT}))
    if config.schedule != "interleaved_1f1b":
        return tuple((rank, micro) for micro in range(config.micro))
    pp, last_chunk = config.pp, config.vpp - 1
    return tuple(
        ((last_chunk - chunk) * pp + rank, micro) for micro, chunk in _schedule_table(config)
    )


def warmup_count(config: ScheduleConfig, rank: int) -> int:
    """Forwards the rank runs before its first backward (Megatron's warm-up count).

    gpipe and forward-only: every forward (``m * vpp``). 1f1b: ``min(pp - r - 1, m)``.
    interleaved: ``min((pp - r - 1) * 2 + (vpp - 1) * pp, m * vpp)``.
    """
    check_rank(config, rank)
    total = config.micro * config.vpp
    if config.forward_only or config.schedule == "gpipe":
        return total
    if config.schedule == "1f1b":
        return min(config.pp - rank - 1, config.micro)
    return min((config.pp - rank - 1) * 2 + (config.vpp - 1) * config.pp, total)


def weight_lag(config: ScheduleConfig, rank: int) -> int:
    """How many BWD_WEIGHTs of standalone BWD_INPUTs the rank keeps deferred (ZB-H1).

    0 without split_dw; ``rank`` for gpipe and 1f1b; ``2 * rank`` for interleaved.
    """
    check_rank(config, rank)
    if not config.split_dw:
        return 0
    return 2 * rank if config.schedule == "interleaved_1f1b" else rank


def _base_sequence(config: ScheduleConfig, rank: int) -> list[int]:
    """The family's F/B sequence before split and overlap: forward ``k`` is ``k``, backward
    ``k`` is ``~k`` (negative), indices into forward_chunks / backward_chunks."""
    total = config.micro * config.vpp
    if config.forward_only:
        return list(range(total))
    if config.schedule == "gpipe":
        return [*range(total), *(~k for k in range(total))]
    warmup = warmup_count(config, rank)
    tokens = list(range(warmup))
    for k in range(total - warmup):
        tokens.append(warmup + k)
        tokens.append(~k)
    tokens.extend(~k for k in range(total - warmup, total))
    return tokens


def _family_order(config: ScheduleConfig, rank: int) -> Order:
    """The order of a family of ``zero_bubble`` / ``v_schedules``, or the given order."""
    pp, vpp, micro = config.pp, config.vpp, config.micro
    if config.order is not None:
        order = config.order.orders[rank]
    elif config.schedule == "looped_bfs":
        order = looped_bfs_order(pp, vpp, micro, rank)
    elif config.schedule == "interleaved_zb":
        order = interleaved_zb_order(pp, vpp, micro, rank)
    elif config.schedule == "zbv":
        order = zbv_order(pp, micro, rank)
    else:
        order = dualpipev_order(pp, micro, rank)
    if config.forward_only:
        return tuple(leaf for leaf in iter_leaves(order) if leaf.kind is _FWD)
    return order


def compute_order(config: ScheduleConfig, rank: int) -> Order:
    """The rank's compute slots in execution order (see the module docstring)."""
    check_rank(config, rank)
    if config.order is not None or config.schedule in FAMILIES:
        return _family_order(config, rank)
    step_of = trusted_step  # kinds are constants, (stage, micro) come from the config
    pp = config.pp
    last_chunk = config.vpp - 1
    # Virtual micro-batch k -> (micro, chunk); the backward of k uses chunk last - chunk.
    if config.schedule == "interleaved_1f1b":
        table = _schedule_table(config)
    else:
        table = [(micro, 0) for micro in range(config.micro)]
    fwd = [step_of(_FWD, chunk * pp + rank, micro) for micro, chunk in table]
    tokens = _base_sequence(config, rank)
    split = config.split_dw
    overlap = config.overlap_b_f
    lag = weight_lag(config, rank)
    pending: deque[MetaStep] = deque()
    out: list[MetaStep] = []
    append = out.append
    position = 0
    count = len(tokens)
    while position < count:
        token = tokens[position]
        position += 1
        if token >= 0:
            append(fwd[token])
            continue
        micro, chunk = table[~token]
        stage = (last_chunk - chunk) * pp + rank
        is_split = split and stage != 0
        backward = step_of(_BWD_INPUT if is_split else _BWD, stage, micro)
        if overlap and position < count and tokens[position] >= 0:
            partner = fwd[tokens[position]]
            position += 1
            append(step_of(_OVERLAP_B_F, stage, micro, None, (backward, partner)))
            if is_split:
                append(step_of(_BWD_WEIGHT, stage, micro))
            continue
        append(backward)
        if is_split:
            pending.append(step_of(_BWD_WEIGHT, stage, micro))
            while len(pending) > lag:
                append(pending.popleft())
    out.extend(pending)
    return tuple(out)
