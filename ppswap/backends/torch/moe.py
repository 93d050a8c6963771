"""``MoE``: a mixture-of-experts block for torch stages, dropless, with expert parallelism.

``MoE(dim, ffn_dim, num_experts, top_k=2)`` maps ``(..., dim)`` to ``(..., dim)``: a
softmax router picks each token's ``top_k`` experts (ties go to the lower expert index:
a stable sort), the picked probabilities renormalized to sum to one weigh the experts'
outputs, summed in pick order. Experts are MLPs ``silu(x @ w_in[e]) @ w_out[e]`` held as
stacked weights (``w_in``: ``(num_experts, dim, ffn_dim)``, ``w_out``:
``(num_experts, ffn_dim, dim)``). No token is dropped, so a split block computes what
the unsplit one does.

``ppswap.moe.expert_parallel`` keeps one EP rank's experts (``keep_experts``); the run
binds an all-to-all (``bind_exchange``, ``ppswap.moe.AllToAll``). A forward then sends
each (token, pick) row to the EP member that holds its expert (the *dispatch*, with a
first all-to-all of the per-expert row counts: the splits vary per call, zero
included), runs its own experts on the rows it received, and sends the results back
(the *combine*). ``all_to_all_rows`` is the autograd function of both: the backward of
a dispatch is a combine-shaped all-to-all of the gradients, and the other way round.
Unbound and unsplit, the block computes every expert itself.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.nn import functional

from ppswap.core.all_to_all import AllToAll, LocalExchange

__all__ = ["MoE", "all_to_all_rows"]

Counts = npt.NDArray[np.int64]


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be an int in {low}..{high}, got {value!r}")
    return value


def _exchange_rows(exchange: AllToAll, key: str, rows: torch.Tensor, send: Counts) -> torch.Tensor:
    """Send ``rows`` split by ``send`` (rows per member) and concatenate what came back."""
    host = rows.detach().to("cpu").contiguous().numpy()
    bounds = np.cumsum(send)[:-1]
    parts = [part.copy() for part in np.split(host, bounds)]
    received = exchange.all_to_all(key, parts)
    return torch.from_numpy(np.concatenate(received)).to(rows.device)


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, rows: torch.Tensor, exchange: AllToAll, key: str, send: Counts, recv: Counts
    ) -> torch.Tensor:
        ctx.exchange, ctx.key, ctx.recv = exchange, key, recv
        return _exchange_rows(exchange, key, rows, send)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = _exchange_rows(ctx.exchange, f"{ctx.key}.grad", grad, ctx.recv)
        return back, None, None, None, None


def all_to_all_rows(
    rows: torch.Tensor, exchange: AllToAll, key: str, send: Counts, recv: Counts
) -> torch.Tensor:
    """Differentiable all-to-all of ``rows``: ``send[j]`` rows (in order) to member
    ``j``; returns the ``recv[j]`` rows from each member ``j``, in member order. The
    backward sends the gradient rows back the other way (key ``{key}.grad``)."""
    out: torch.Tensor = _AllToAllRows.apply(rows, exchange, key, send, recv)
    return out


class MoE(nn.Module):
    """A dropless top-k MoE block (module docstring)."""

    def __init__(self, dim: int, ffn_dim: int, num_experts: int, top_k: int = 2) -> None:
        super().__init__()
        _check_int("dim", dim, 1)
        _check_int("ffn_dim", ffn_dim, 1)
        _check_int("num_experts", num_experts, 1)
        _check_int("top_k", top_k, 1, num_experts)
        self.dim, self.ffn_dim, self.top_k = dim, ffn_dim, top_k
        self._num_experts = num_experts
        self._kept = (0, num_experts)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, dim, ffn_dim) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(num_experts, ffn_dim, dim) / math.sqrt(ffn_dim))
        self._exchange: AllToAll = LocalExchange()
        self._key = "moe"

    # -- ppswap.moe.ExpertBlock -------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def kept_experts(self) -> tuple[int, int]:
        return self._kept

    @property
    def runs_in_fibers(self) -> bool:
        """torch's autograd accepts calls from any thread, interleaved."""
        return True

    def keep_experts(self, first: int, count: int) -> None:
        """Keep experts ``first .. first + count - 1`` (the parameters stay the same
        objects; their data is sliced, the rest released)."""
        if not (first >= 0 and count >= 1 and first + count <= self._num_experts):
            raise ValueError(
                f"experts {first}..{first + count - 1} are not within 0..{self._num_experts - 1}"
            )
        with torch.no_grad():
            self.w_in.data = self.w_in.data[first : first + count].clone()
            self.w_out.data = self.w_out.data[first : first + count].clone()
        self._kept = (first, count)

    def expert_parameters(self) -> tuple[torch.Tensor, ...]:
        return (self.w_in, self.w_out)

    def bind_exchange(self, exchange: AllToAll | None, key: str = "moe") -> None:
        """Route tokens over ``exchange`` (None: the one-member group) under ``key``."""
        self._exchange = LocalExchange() if exchange is None else exchange
        self._key = key

    # -- compute ----------------------------------------------------------------------------
    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts ``(T, k)`` and their renormalized weights."""
        probs = functional.softmax(self.router(tokens), dim=-1)
        order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices
        picked = order[:, : self.top_k]
        weights = probs.gather(1, picked)
        return picked, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE input must end in dim={self.dim}, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.dim)
        picked, weights = self.route(tokens)
        exchange, key, k = self._exchange, self._key, self.top_k
        first, local = self._kept
        members = exchange.size
        if local * members != self._num_experts or first != exchange.index * local:
            raise RuntimeError(
                f"this MoE block keeps experts {first}..{first + local - 1} of "
                f"{self._num_experts}, which does not fit EP member {exchange.index} of "
                f"{members}: a block split by ppswap.moe.expert_parallel computes inside "
                "a pipeline run over its mesh, whose EP group holds the other experts"
            )
        experts = picked.reshape(-1).to("cpu").numpy()
        by_expert = np.argsort(experts, kind="stable")
        counts = np.bincount(experts, minlength=self._num_experts).astype(np.int64)
        send_counts = counts.reshape(members, local)
        recv_counts = np.stack(exchange.all_to_all(f"{key}.counts", list(send_counts))).reshape(
            members, local
        )
        send, recv = send_counts.sum(axis=1), recv_counts.sum(axis=1)
        rows = tokens.index_select(0, torch.from_numpy(by_expert // k).to(x.device))
        received = all_to_all_rows(rows, exchange, f"{key}.dispatch", send, recv)
        done = self._run_experts(received, recv_counts)
        back = all_to_all_rows(done, exchange, f"{key}.combine", recv, send)
        unsort = np.empty_like(by_expert)
        unsort[by_expert] = np.arange(by_expert.size)
        per_pick = back.index_select(0, torch.from_numpy(unsort).to(x.device))
        per_pick = per_pick.reshape(-1, k, self.dim) * weights.unsqueeze(-1)
        out = per_pick[:, 0]
        for slot in range(1, k):
            out = out + per_pick[:, slot]
        return out.reshape(x.shape)

    def _run_experts(self, rows: torch.Tensor, counts: Counts) -> torch.Tensor:
        """The kept experts on ``rows`` (from each member, its rows of each kept expert in
        turn, ``counts[member, expert]``), in the same order."""
        starts = np.concatenate([[0], np.cumsum(counts.reshape(-1))[:-1]]).reshape(counts.shape)
        by_expert = np.concatenate(
            [
                np.arange(starts[m, e], starts[m, e] + counts[m, e])
                for e in range(counts.shape[1])
                for m in range(counts.shape[0])
            ]
            + [np.zeros(0, dtype=np.int64)]
        ).astype(np.int64)
        grouped = rows.index_select(0, torch.from_numpy(by_expert).to(rows.device))
        sizes = counts.sum(axis=0).tolist()
        outputs = [
            functional.silu(part @ self.w_in[e]) @ self.w_out[e]
            for e, part in enumerate(torch.split(grouped, sizes))
        ]
        done = torch.cat(outputs) if outputs else grouped
        unsort = np.empty_like(by_expert)
        unsort[by_expert] = np.arange(by_expert.size)
        return done.index_select(0, torch.from_numpy(unsort).to(rows.device))
