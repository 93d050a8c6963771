"""``MoE``: a mixture-of-experts block for torch stages, dropless, with expert parallelism.

``MoE(dim, ffn_dim, num_experts, top_k=2, aux_loss_coef=0.0)`` maps ``(..., dim)`` to
``(..., dim)``: a softmax router picks each token's ``top_k`` experts (ties go to the
lower expert index: a stable sort), the picked probabilities renormalized to sum to one
weigh the experts' outputs, summed in pick order. Experts are MLPs
``silu(x @ w_in[e]) @ w_out[e]`` held as stacked weights (``w_in``:
``(num_experts, dim, ffn_dim)``, ``w_out``: ``(num_experts, ffn_dim, dim)``). No token
is dropped, so a split block computes what the unsplit one does.

``ppswap.moe.expert_parallel`` keeps one EP rank's experts (``keep_experts``); the run
binds an all-to-all (``bind_exchange``, ``ppswap.moe.AllToAll``). A forward then sends
each (token, pick) row to the EP member that holds its expert (the *dispatch*, with a
first all-to-all of the per-expert row counts: the splits vary per call, zero
included), runs its own experts on the rows it received, and sends the results back
(the *combine*); the host side of this is ``ppswap.core.expert_routing``, shared with
the MindSpore block. ``all_to_all_rows`` is the autograd function of both: the backward
of a dispatch is a combine-shaped all-to-all of the gradients, and the other way round.
Unbound and unsplit, the block computes every expert itself.

The load-balancing loss (``aux_loss_coef > 0``, Switch Transformer / GShard form):
``aux_loss_coef * num_experts * sum_e f_e * P_e`` over the tokens of one forward (with
expert parallelism, this rank's own tokens: the counts of the other members are not
used), ``f_e`` the share of the (token, pick) slots routed to expert ``e``, ``P_e`` the
mean router probability of ``e``; only ``P_e`` carries a gradient. After each forward it
is ``aux_loss`` (a scalar in the graph), for a caller to add to its loss. In a pipeline
run the last stage alone has the loss, so the run binds a gradient scale
(``bind_aux``: the backward seed, ``loss_scale / micro_batch_num``) and the block's
backward adds the term's gradient times that scale itself, as if each micro-batch's
term were added to its loss; FSDP's mean over the dp replicas then applies to it as to
the loss. ``aux_loss_coef=0`` adds no operation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from torch import nn
from torch.nn import functional

from ppswap.core.all_to_all import AllToAll, LocalExchange
from ppswap.core.expert_routing import (
    Dispatch,
    check_block_args,
    exchange_rows,
    load_fractions,
    plan_dispatch,
)

__all__ = ["MoE", "all_to_all_rows"]

Counts = npt.NDArray[np.int64]


def _exchange_rows(exchange: AllToAll, key: str, rows: torch.Tensor, send: Counts) -> torch.Tensor:
    host = rows.detach().to("cpu").contiguous().numpy()
    return torch.from_numpy(exchange_rows(exchange, key, host, send)).to(rows.device)


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


class _AuxGrad(torch.autograd.Function):
    """``out`` unchanged; its backward also gives ``aux`` the gradient ``scale``: the
    load-balancing term's share of a loss seeded with ``scale``."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad, torch.full((), ctx.scale, dtype=grad.dtype, device=grad.device), None


class MoE(nn.Module):
    """A dropless top-k MoE block (module docstring)."""

    def __init__(
        self,
        dim: int,
        ffn_dim: int,
        num_experts: int,
        top_k: int = 2,
        aux_loss_coef: float = 0.0,
    ) -> None:
        super().__init__()
        self._aux_loss_coef = check_block_args(dim, ffn_dim, num_experts, top_k, aux_loss_coef)
        self.dim, self.ffn_dim, self.top_k = dim, ffn_dim, top_k
        self._num_experts = num_experts
        self._kept = (0, num_experts)
        self.router = nn.Linear(dim, num_experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(num_experts, dim, ffn_dim) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(num_experts, ffn_dim, dim) / math.sqrt(ffn_dim))
        self._exchange: AllToAll = LocalExchange()
        self._key = "moe"
        self._aux_grad_scale = 0.0
        self._aux_record: Callable[[Any], None] | None = None
        self.aux_loss: torch.Tensor | None = None  # the last forward's (module docstring)

    # -- ppswap.core.all_to_all.ExpertBlock -------------------------------------------------
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

    @property
    def aux_loss_coef(self) -> float:
        return self._aux_loss_coef

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

    def bind_aux(self, grad_scale: float, record: Callable[[Any], None] | None = None) -> None:
        """The load-balancing term's gradient scale in this block's backward (0: none)
        and where each forward's term goes, detached (module docstring)."""
        self._aux_grad_scale, self._aux_record = grad_scale, record

    # -- compute ----------------------------------------------------------------------------
    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's ``top_k`` experts ``(T, k)`` and their renormalized weights."""
        return self._pick(functional.softmax(self.router(tokens), dim=-1))

    def _pick(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        order = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices
        picked = order[:, : self.top_k]
        weights = probs.gather(1, picked)
        return picked, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE input must end in dim={self.dim}, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.dim)
        probs = functional.softmax(self.router(tokens), dim=-1)
        picked, weights = self._pick(probs)
        exchange, key, k = self._exchange, self._key, self.top_k
        route = plan_dispatch(
            picked.to("cpu").numpy(),
            num_experts=self._num_experts,
            kept=self._kept,
            exchange=exchange,
            key=key,
        )
        device = x.device
        rows = tokens.index_select(0, torch.from_numpy(route.token_of_row).to(device))
        received = all_to_all_rows(rows, exchange, f"{key}.dispatch", route.send, route.recv)
        done = self._run_experts(received, route)
        back = all_to_all_rows(done, exchange, f"{key}.combine", route.recv, route.send)
        per_pick = back.index_select(0, torch.from_numpy(route.restore).to(device))
        per_pick = per_pick.reshape(-1, k, self.dim) * weights.unsqueeze(-1)
        out = per_pick[:, 0]
        for slot in range(1, k):
            out = out + per_pick[:, slot]
        if self._aux_loss_coef:
            out = self._with_aux_loss(out, probs, route)
        return out.reshape(x.shape)

    def _run_experts(self, rows: torch.Tensor, route: Dispatch) -> torch.Tensor:
        """The kept experts on the received ``rows``, in the same order."""
        device = rows.device
        grouped = rows.index_select(0, torch.from_numpy(route.expert_order).to(device))
        outputs = [
            functional.silu(part @ self.w_in[e]) @ self.w_out[e]
            for e, part in enumerate(torch.split(grouped, route.expert_sizes))
        ]
        done = torch.cat(outputs) if outputs else grouped
        return done.index_select(0, torch.from_numpy(route.expert_restore).to(device))

    def _with_aux_loss(
        self, out: torch.Tensor, probs: torch.Tensor, route: Dispatch
    ) -> torch.Tensor:
        """Record this forward's load-balancing term; ``out`` carrying its gradient where
        a run bound a scale (module docstring)."""
        fractions = torch.from_numpy(load_fractions(route.counts)).to(probs.device, probs.dtype)
        aux = self._aux_loss_coef * self._num_experts * (fractions * probs.mean(dim=0)).sum()
        self.aux_loss = aux
        if self._aux_record is not None:
            self._aux_record(aux.detach())
        if not self._aux_grad_scale:
            return out
        result: torch.Tensor = _AuxGrad.apply(out, aux, self._aux_grad_scale)
        return result
