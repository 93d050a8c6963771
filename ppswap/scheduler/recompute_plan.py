"""The recompute pass: one RECOMPUTE step per recomputed chunk, and the per-chunk policy.

A *recomputed* chunk ``(stage, micro)`` keeps after its FWD only what its
recompute-wrapped blocks need to run again (their inputs and the random-number state of
the forward) and drops what those blocks saved; its RECOMPUTE step runs them again to
regenerate those saved tensors for its backward. The pass is pure, like the swap pass,
and runs after it (``inject_recompute_steps`` on a finalized order, swap steps included):
removing the RECOMPUTE steps gives the input back exactly.

The per-chunk policy is a value of the IR, in and out (``ChunkPolicy``):

- ``"keep"``: the chunk's saved tensors stay on device until its backward;
- ``"swap"``: its four swap steps move the saved tensors ``swap_wrapper`` selected;
- ``"recompute"``: a RECOMPUTE step regenerates the saved tensors of its
  recompute-wrapped blocks;
- ``"recompute+swap"``: both: the recompute-wrapped blocks are recomputed, and the swap
  steps move what the other (swap-wrapped) blocks saved. A block wrapped by both is
  recomputed: recompute wins, since a recomputed block keeps nothing to move.

``orders_for_policies(config, policies)`` lowers a mapping ``(stage, micro) -> policy``
(what a planner chooses) to every rank's finalized order; ``chunk_policies(order)`` reads
the policy of each chunk back from a finalized order (what ``RankStats.chunk_policy``
reports). The runtime's ``recompute=True`` recomputes every chunk of the stages with a
recompute-wrapped block (``recomputed_chunks``) on top of its swap policy.

Placement of RECOMPUTE(s, i), with ``c`` the top-level index of the chunk's consumer
(BWD(s, i), BWD_INPUT(s, i) with the dx/dw split, or the OVERLAP_B_F / OVERLAP_F_B
composite holding it); BWD_WEIGHT never recomputes (it reads what the RECOMPUTE
regenerated, kept until it runs):

- as early as the gap before the consumer allows: before the consumer's trailing run of
  receive-side steps (RECV_*, or a BATCH_SEND_RECV of receives only: one that holds a
  send is posted only after the steps before it, so it is not passed) and load steps
  (SWAP_LAUNCH_LOAD, SWAP_WAIT_LOAD), so the recompute runs while the rank waits for the
  gradient it receives and the loads' copies run; a composite's other leaf (a FWD of
  another micro-batch) comes after it, in its own collection;
- never before the chunk's FWD's top-level step, and, where the stage has FSDP steps,
  never before the stage's last FSDP step before the consumer (which is the FSDP_UNSHARD
  that opens the consumer's use run, or a step of the use run it continues): the
  parameters the blocks run with are unsharded there;
- only between top-level steps: never inside a BATCH_SEND_RECV or a composite.

Several RECOMPUTE steps at one point are ordered by chunk. Cost: linear in the order.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Literal, get_args

from ppswap.scheduler.analysis import check_order
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_exec_order
from ppswap.scheduler.schedules import check_rank
from ppswap.scheduler.steps import (
    BATCH_SEND_RECV,
    BWD,
    BWD_INPUT,
    FSDP_KINDS,
    FWD,
    RECOMPUTE,
    RECV_B,
    RECV_F,
    SWAP_LAUNCH_LOAD,
    SWAP_LAUNCH_OFFLOAD,
    SWAP_WAIT_LOAD,
    MetaStep,
    Order,
    trusted_step,
)
from ppswap.scheduler.swap_plan import inject_swap_steps

__all__ = [
    "CHUNK_POLICIES",
    "ChunkPolicy",
    "chunk_policies",
    "inject_recompute_steps",
    "orders_for_policies",
    "recomputed_chunks",
    "strip_recompute_steps",
]

Chunk = tuple[int, int]
ChunkPolicy = Literal["keep", "swap", "recompute", "recompute+swap"]
CHUNK_POLICIES: tuple[str, ...] = get_args(ChunkPolicy)


def _check_chunks(chunks: object) -> frozenset[Chunk]:
    if not isinstance(chunks, Collection) or isinstance(chunks, str | bytes):
        raise TypeError(f"chunks must be a collection of (stage, micro) pairs, got {chunks!r}")
    out: set[Chunk] = set()
    for chunk in chunks:
        if not (
            isinstance(chunk, tuple)
            and len(chunk) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in chunk)
        ):
            raise TypeError(f"chunks must hold (stage, micro) int pairs, got {chunk!r}")
        out.add(chunk)
    return frozenset(out)


def _is_early_step(step: MetaStep) -> bool:
    """A step the RECOMPUTE goes ahead of: a receive (or a batch of receives only), a
    load. Never a send, nor a batch holding one: the send would wait for the recompute."""
    kind = step.kind
    if kind is RECV_F or kind is RECV_B or kind is SWAP_LAUNCH_LOAD or kind is SWAP_WAIT_LOAD:
        return True
    return kind is BATCH_SEND_RECV and all(
        sub.kind is RECV_F or sub.kind is RECV_B for sub in step.sub_steps
    )


def inject_recompute_steps(
    order: Order, config: ScheduleConfig, rank: int, chunks: Collection[Chunk]
) -> Order:
    """``order`` (finalized, swap steps included) with a RECOMPUTE step for each chunk of
    ``chunks`` on this rank's stages, at the point of the module docstring. Chunks of other
    ranks' stages are ignored (one selection serves every rank); a chunk of this rank that
    the order does not run forward and backward raises ValueError, so does a
    forward-only config with any chunk of this rank."""
    check_order(order)
    check_rank(config, rank)
    wanted = {c for c in _check_chunks(chunks) if c[0] in config.stages_of(rank)}
    if not wanted:
        return order
    if config.forward_only:
        raise ValueError(
            f"chunks holds {sorted(wanted)[0]} of rank {rank}, but a forward-only order has "
            "no backward to recompute for"
        )
    fwd_at: dict[Chunk, int] = {}
    consumer_at: dict[Chunk, int] = {}
    last_fsdp: dict[int, int] = {}  # stage -> index of its latest FSDP step so far
    fsdp_floor: dict[Chunk, int] = {}
    for index, step in enumerate(order):
        if step.kind in FSDP_KINDS:
            last_fsdp[step.stage] = index
            continue
        for leaf in step.sub_steps if step.is_compute and step.sub_steps else (step,):
            chunk = (leaf.stage, leaf.micro)
            if chunk not in wanted:
                continue
            if leaf.kind is FWD:
                fwd_at[chunk] = index
            elif leaf.kind is BWD or leaf.kind is BWD_INPUT:
                consumer_at[chunk] = index
                if leaf.stage in last_fsdp:
                    fsdp_floor[chunk] = last_fsdp[leaf.stage]
    at: dict[int, list[Chunk]] = {}
    for chunk in sorted(wanted):
        fwd, consumer = fwd_at.get(chunk), consumer_at.get(chunk)
        if fwd is None or consumer is None or consumer < fwd:
            raise ValueError(
                f"chunks holds (stage, micro) = {chunk}, which rank {rank}'s order does not "
                "run forward and then backward"
            )
        floor = max(fwd, fsdp_floor.get(chunk, fwd)) + 1
        point = consumer
        while point > floor and _is_early_step(order[point - 1]):
            point -= 1
        at.setdefault(point, []).append(chunk)
    out: list[MetaStep] = []
    start = 0
    for point in sorted(at):
        out += order[start:point]
        out += (trusted_step(RECOMPUTE, stage, micro) for stage, micro in at[point])
        start = point
    out += order[start:]
    return tuple(out)


def strip_recompute_steps(order: Order) -> Order:
    """``order`` without its RECOMPUTE steps: the inverse of ``inject_recompute_steps``."""
    check_order(order)
    return tuple(step for step in order if step.kind is not RECOMPUTE)


def chunk_policies(order: Order) -> dict[Chunk, ChunkPolicy]:
    """The policy of every chunk with a FWD in a finalized ``order``, read from its steps:
    a SWAP_LAUNCH_OFFLOAD makes it swapped, a RECOMPUTE recomputed."""
    check_order(order)
    swapped: set[Chunk] = set()
    recomputed: set[Chunk] = set()
    chunks: list[Chunk] = []
    for step in order:
        for leaf in step.sub_steps if step.is_compute and step.sub_steps else (step,):
            if leaf.kind is FWD:
                chunks.append(leaf.chunk)
            elif leaf.kind is SWAP_LAUNCH_OFFLOAD:
                swapped.add(leaf.chunk)
            elif leaf.kind is RECOMPUTE:
                recomputed.add(leaf.chunk)
    policies: dict[Chunk, ChunkPolicy] = {}
    for chunk in chunks:
        if chunk in recomputed:
            policies[chunk] = "recompute+swap" if chunk in swapped else "recompute"
        else:
            policies[chunk] = "swap" if chunk in swapped else "keep"
    return policies


def recomputed_chunks(config: ScheduleConfig, stages: Iterable[int]) -> frozenset[Chunk]:
    """Every chunk of ``stages`` (``recompute=True``: the stages with a recompute-wrapped
    block): each micro-batch of each."""
    return frozenset((stage, micro) for stage in stages for micro in range(config.micro))


def _check_policies(policies: object) -> Mapping[Chunk, ChunkPolicy]:
    if not isinstance(policies, Mapping):
        raise TypeError(
            f"policies must be a mapping (stage, micro) -> policy, got {type(policies).__name__}"
        )
    _check_chunks(list(policies))
    for chunk, policy in policies.items():
        if policy not in CHUNK_POLICIES:
            raise ValueError(
                f"policies[{chunk}] must be one of {', '.join(CHUNK_POLICIES)}, got {policy!r}"
            )
    return policies


def orders_for_policies(
    config: ScheduleConfig, policies: Mapping[Chunk, ChunkPolicy]
) -> tuple[Order, ...]:
    """Every rank's finalized order for a per-chunk ``policies`` (a chunk absent: keep).

    The swapped chunks (``"swap"``, ``"recompute+swap"``) are placed by the swap pass's
    anchors (``inject_swap_steps(chunks=...)``, which needs ``config.swap`` and refuses a
    chunk of gap < 2), the recomputed ones by ``inject_recompute_steps``. Not validated:
    ``validate.validate_all`` does that.
    """
    _check_policies(policies)
    swapped = frozenset(c for c, p in policies.items() if p in ("swap", "recompute+swap"))
    recomputed = frozenset(c for c, p in policies.items() if p.startswith("recompute"))
    if swapped and not config.swap:
        raise ValueError(
            f"policies swaps {len(swapped)} chunk(s), which needs a config with swap=True"
        )
    orders: list[Order] = []
    for rank in range(config.pp):
        order = build_exec_order(config, rank)
        if config.swap:
            order = inject_swap_steps(_without_swap(order), config, rank, chunks=sorted(swapped))
        orders.append(inject_recompute_steps(order, config, rank, recomputed))
    return tuple(orders)


def _without_swap(order: Sequence[MetaStep]) -> Order:
    return tuple(step for step in order if not step.is_swap)
