"""The host side of a MoE block's forward, shared by the backends' blocks (numpy only).

A block routes each token to its ``top_k`` experts (``picked``, ``(T, k)``: a host
array, the decision is made on the host), then, with its experts split over an EP group
of ``members`` ranks each keeping ``local`` consecutive experts:

1. ``plan_dispatch`` sorts the ``T * k`` (token, pick) rows by expert (stable: in token
   order within an expert), exchanges the per-expert row counts with the group (the
   splits vary per call, zero included) and returns a ``Dispatch``: which token each sent
   row is (``token_of_row``), how many rows go to and come from each member (``send``,
   ``recv``), how the received rows group by kept expert (``expert_order``,
   ``expert_sizes``, ``expert_restore``) and where each (token, pick) row is among the
   rows that come back (``restore``);
2. the block gathers ``tokens[token_of_row]``, sends them (``exchange_rows``: the
   *dispatch*), runs its kept experts on ``received[expert_order]`` in ``expert_sizes``
   parts, puts the results back in received order (``expert_restore``), sends them back
   (the *combine*) and takes ``back[restore]``, ``(T * k, dim)`` in (token, pick) order.

``exchange_rows`` sends host copies, so a buffer an all-to-all in flight reads is never
one a framework tensor (hence swap) owns. With one member (every expert local) the
exchanges are the identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from ppswap.core.all_to_all import AllToAll

__all__ = [
    "Dispatch",
    "check_block_args",
    "check_expert_fit",
    "exchange_rows",
    "inverse",
    "load_fractions",
    "plan_dispatch",
]

IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class Dispatch:
    """Where a forward's rows go (module docstring). ``counts``: this block's picks per
    expert, over all ``num_experts`` (its own tokens only)."""

    counts: IntArray
    token_of_row: IntArray
    restore: IntArray
    send: IntArray
    recv: IntArray
    expert_order: IntArray
    expert_sizes: list[int]
    expert_restore: IntArray


def inverse(order: IntArray) -> IntArray:
    """The permutation that undoes ``order``: ``a[order][inverse(order)] == a``."""
    undo = np.empty_like(order)
    undo[order] = np.arange(order.size, dtype=order.dtype)
    return undo


def check_expert_fit(kept: tuple[int, int], num_experts: int, exchange: AllToAll) -> None:
    """A block keeping experts ``kept`` (``first``, ``count``) must be EP member
    ``exchange.index`` of ``exchange.size`` members that split ``num_experts`` evenly;
    RuntimeError otherwise (a split block called outside a run over its mesh)."""
    first, local = kept
    if local * exchange.size != num_experts or first != exchange.index * local:
        raise RuntimeError(
            f"this MoE block keeps experts {first}..{first + local - 1} of {num_experts}, "
            f"which does not fit EP member {exchange.index} of {exchange.size}: a block "
            "split by ppswap.moe.expert_parallel computes inside a pipeline run over its "
            "mesh, whose EP group holds the other experts"
        )


def _grouped_by_expert(recv_counts: IntArray) -> IntArray:
    """The received rows (from each member in turn, its rows of each kept expert in
    turn: ``recv_counts[member, expert]``) reordered expert by expert."""
    members, local = recv_counts.shape
    starts = np.concatenate([[0], np.cumsum(recv_counts.reshape(-1))[:-1]]).reshape(members, local)
    parts = [
        np.arange(starts[m, e], starts[m, e] + recv_counts[m, e], dtype=np.int64)
        for e in range(local)
        for m in range(members)
    ]
    return np.concatenate([*parts, np.zeros(0, dtype=np.int64)])


def plan_dispatch(
    picked: npt.NDArray[np.integer[Any]],
    *,
    num_experts: int,
    kept: tuple[int, int],
    exchange: AllToAll,
    key: str,
) -> Dispatch:
    """Step 1 of the module docstring: ``picked`` ``(T, k)`` expert indices; the counts
    exchanged under ``{key}.counts``."""
    check_expert_fit(kept, num_experts, exchange)
    members, local = exchange.size, kept[1]
    top_k = picked.shape[1]
    experts = picked.reshape(-1).astype(np.int64)
    by_expert = np.argsort(experts, kind="stable").astype(np.int64)
    counts = np.bincount(experts, minlength=num_experts).astype(np.int64)
    send_counts = counts.reshape(members, local)
    received = exchange.all_to_all(f"{key}.counts", list(send_counts))
    recv_counts = np.stack(received).astype(np.int64).reshape(members, local)
    expert_order = _grouped_by_expert(recv_counts)
    return Dispatch(
        counts=counts,
        token_of_row=by_expert // top_k,
        restore=inverse(by_expert),
        send=send_counts.sum(axis=1),
        recv=recv_counts.sum(axis=1),
        expert_order=expert_order,
        expert_sizes=[int(n) for n in recv_counts.sum(axis=0)],
        expert_restore=inverse(expert_order),
    )


def exchange_rows(
    exchange: AllToAll, key: str, rows: npt.NDArray[np.generic], send: IntArray
) -> npt.NDArray[np.generic]:
    """Send host ``rows`` split by ``send`` (rows per member, in order), each part a copy
    of its own; the rows every member sent here, concatenated in member order."""
    parts = [part.copy() for part in np.split(rows, np.cumsum(send)[:-1])]
    return np.concatenate(exchange.all_to_all(key, parts))


def check_block_args(
    dim: object, ffn_dim: object, num_experts: object, top_k: object, aux_loss_coef: object
) -> float:
    """A MoE block's constructor arguments, checked (ValueError naming the first bad one);
    returns ``aux_loss_coef`` as a float."""
    for name, value, high in (
        ("dim", dim, None),
        ("ffn_dim", ffn_dim, None),
        ("num_experts", num_experts, None),
        ("top_k", top_k, num_experts),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if isinstance(high, int) and value > high:
            raise ValueError(f"{name} must be an int in 1..{high}, got {value!r}")
    if (
        not isinstance(aux_loss_coef, int | float)
        or isinstance(aux_loss_coef, bool)
        or not math.isfinite(aux_loss_coef)
        or aux_loss_coef < 0
    ):
        raise ValueError(
            f"aux_loss_coef must be a finite number >= 0 (0: no load-balancing loss), "
            f"got {aux_loss_coef!r}"
        )
    return float(aux_loss_coef)


def load_fractions(counts: IntArray) -> npt.NDArray[np.float32]:
    """``f_e`` of the load-balancing loss: the share of the routed (token, pick) slots
    that went to each expert (``Dispatch.counts`` over their sum)."""
    total = max(int(counts.sum()), 1)
    fractions: npt.NDArray[np.float32] = (counts / total).astype(np.float32)
    return fractions
