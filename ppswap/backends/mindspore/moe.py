"""``MoE``: the mixture-of-experts block for MindSpore stages (PyNative), as
``ppswap.backends.torch.moe.MoE``: the same constructor, routing (softmax, ``top_k``
picks, ties to the lower expert index, renormalized weights), experts
``silu(x @ w_in[e]) @ w_out[e]`` as stacked weights, dropless, the same all-to-alls
under ``ppswap.moe.expert_parallel`` (their host side is ``ppswap.core.expert_routing``)
and the same optional load-balancing loss (``aux_loss_coef``, ``aux_loss``,
``bind_aux``: see the torch block's docstring).

The routing decision (which experts, hence the split sizes) is made on the host from the
router's probabilities; the weights stay in the graph. ``AllToAllRows`` is a cell with a
custom ``bprop``: its backward sends the gradient rows back the other way (key
``{key}.grad``), so a dispatch's backward is a combine-shaped all-to-all and the other
way round. ``AuxGrad`` passes the block's output through and, in its ``bprop``, gives
the load-balancing term the run's gradient scale.

MindSpore's PyNative autograd is not thread-safe and cannot record two forwards
interleaved, so a split block runs with one rank per process (MPI); ranks sharing one
process's compute thread cannot run it (``ppswap.core.fiber``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ppswap.core.all_to_all import AllToAll, LocalExchange
from ppswap.core.expert_routing import (
    Dispatch,
    check_block_args,
    exchange_rows,
    load_fractions,
    plan_dispatch,
)

__all__ = ["AllToAllRows", "AuxGrad", "MoE"]

Counts = npt.NDArray[np.int64]


def _exchange_rows(exchange: AllToAll, key: str, rows: Tensor, send: Counts) -> Tensor:
    return Tensor(exchange_rows(exchange, key, rows.asnumpy(), send))


class AllToAllRows(nn.Cell):  # type: ignore[misc]
    """One differentiable all-to-all of rows: ``send[j]`` rows to member ``j``, the
    ``recv[j]`` rows of each member back, in member order."""

    def __init__(self, exchange: AllToAll, key: str, send: Counts, recv: Counts) -> None:
        super().__init__()
        self._exchange, self._key, self._send, self._recv = exchange, key, send, recv

    def construct(self, rows: Tensor) -> Tensor:
        return _exchange_rows(self._exchange, self._key, rows, self._send)

    def bprop(self, rows: Tensor, out: Tensor, dout: Tensor) -> tuple[Tensor]:
        return (_exchange_rows(self._exchange, f"{self._key}.grad", dout, self._recv),)


class AuxGrad(nn.Cell):  # type: ignore[misc]
    """``out`` unchanged; the backward also gives ``aux`` the gradient ``scale``: the
    load-balancing term's share of a loss seeded with ``scale``."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        self._scale = scale

    def construct(self, out: Tensor, aux: Tensor) -> Tensor:
        return out

    def bprop(self, out: Tensor, aux: Tensor, result: Tensor, dout: Tensor) -> tuple[Tensor, ...]:
        return dout, ops.full_like(aux, self._scale)


class MoE(nn.Cell):  # type: ignore[misc]
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
        self.router = nn.Dense(dim, num_experts, has_bias=False)
        self.w_in = Parameter(
            initializer(Normal(1 / math.sqrt(dim)), (num_experts, dim, ffn_dim)), name="w_in"
        )
        self.w_out = Parameter(
            initializer(Normal(1 / math.sqrt(ffn_dim)), (num_experts, ffn_dim, dim)),
            name="w_out",
        )
        self._exchange: AllToAll = LocalExchange()
        self._key = "moe"
        self._aux_grad_scale = 0.0
        self._aux_record: Callable[[Any], None] | None = None
        self.aux_loss: Tensor | None = None  # the last forward's load-balancing term

    # -- ppswap.core.all_to_all.ExpertBlock ----------------------------------------------
    @property
    def num_experts(self) -> int:
        return self._num_experts

    @property
    def kept_experts(self) -> tuple[int, int]:
        return self._kept

    @property
    def runs_in_fibers(self) -> bool:
        """PyNative autograd cannot record two forwards interleaved (module docstring)."""
        return False

    @property
    def aux_loss_coef(self) -> float:
        return self._aux_loss_coef

    def keep_experts(self, first: int, count: int) -> None:
        """Keep experts ``first .. first + count - 1`` (the parameters stay the same
        objects; their data is sliced)."""
        if not (first >= 0 and count >= 1 and first + count <= self._num_experts):
            raise ValueError(
                f"experts {first}..{first + count - 1} are not within 0..{self._num_experts - 1}"
            )
        for param in (self.w_in, self.w_out):
            param.set_data(Tensor(param.asnumpy()[first : first + count].copy()))
        self._kept = (first, count)

    def expert_parameters(self) -> tuple[Parameter, ...]:
        return (self.w_in, self.w_out)

    def bind_exchange(self, exchange: AllToAll | None, key: str = "moe") -> None:
        """Route tokens over ``exchange`` (None: the one-member group) under ``key``."""
        self._exchange = LocalExchange() if exchange is None else exchange
        self._key = key

    def bind_aux(self, grad_scale: float, record: Callable[[Any], None] | None = None) -> None:
        """The load-balancing term's gradient scale in this block's backward (0: none)
        and where each forward's term goes."""
        self._aux_grad_scale, self._aux_record = grad_scale, record

    # -- compute ----------------------------------------------------------------------------
    def route(self, tokens: Tensor) -> tuple[npt.NDArray[np.int64], Tensor]:
        """Each token's ``top_k`` experts ``(T, k)`` (host) and their weights."""
        return self._pick(ops.softmax(self.router(tokens), axis=-1))

    def _pick(self, probs: Tensor) -> tuple[npt.NDArray[np.int64], Tensor]:
        order = np.argsort(-probs.asnumpy(), axis=-1, kind="stable")
        picked = order[:, : self.top_k].astype(np.int64)
        weights = ops.gather_elements(probs, 1, Tensor(picked))
        return picked, weights / weights.sum(axis=-1, keepdims=True)

    def construct(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.dim:
            raise ValueError(f"MoE input must end in dim={self.dim}, got shape {tuple(x.shape)}")
        tokens = x.reshape(-1, self.dim)
        probs = ops.softmax(self.router(tokens), axis=-1)
        picked, weights = self._pick(probs)
        exchange, key, k = self._exchange, self._key, self.top_k
        route = plan_dispatch(
            picked, num_experts=self._num_experts, kept=self._kept, exchange=exchange, key=key
        )
        rows = ops.gather(tokens, Tensor(route.token_of_row), 0)
        received = AllToAllRows(exchange, f"{key}.dispatch", route.send, route.recv)(rows)
        done = self._run_experts(received, route)
        back = AllToAllRows(exchange, f"{key}.combine", route.recv, route.send)(done)
        per_pick = ops.gather(back, Tensor(route.restore), 0).reshape(-1, k, self.dim)
        per_pick = per_pick * weights.expand_dims(-1)
        out = per_pick[:, 0]
        for slot in range(1, k):
            out = out + per_pick[:, slot]
        if self._aux_loss_coef:
            out = self._with_aux_loss(out, probs, route)
        result: Tensor = out.reshape(x.shape)
        return result

    def _run_experts(self, rows: Tensor, route: Dispatch) -> Tensor:
        """The kept experts on the received ``rows``, in the same order."""
        grouped = ops.gather(rows, Tensor(route.expert_order), 0)
        outputs: list[Any] = []
        offset = 0
        for e, size in enumerate(route.expert_sizes):
            part = grouped[offset : offset + size]
            outputs.append(ops.matmul(ops.silu(ops.matmul(part, self.w_in[e])), self.w_out[e]))
            offset += size
        done = ops.cat(outputs)
        result: Tensor = ops.gather(done, Tensor(route.expert_restore), 0)
        return result

    def _with_aux_loss(self, out: Tensor, probs: Tensor, route: Dispatch) -> Tensor:
        """Record this forward's load-balancing term; ``out`` carrying its gradient where
        a run bound a scale (the torch block's docstring)."""
        fractions = Tensor(load_fractions(route.counts)).astype(probs.dtype)
        aux = self._aux_loss_coef * self._num_experts * (fractions * probs.mean(axis=0)).sum()
        self.aux_loss = aux
        if self._aux_record is not None:
            self._aux_record(ops.stop_gradient(aux))
        if not self._aux_grad_scale:
            return out
        result: Tensor = AuxGrad(self._aux_grad_scale)(out, aux)
        return result
