"""``MoE``: the mixture-of-experts block for MindSpore stages (PyNative), as
``ppswap.backends.torch.moe.MoE``: the same constructor, routing (softmax, ``top_k``
picks, ties to the lower expert index, renormalized weights), experts
``silu(x @ w_in[e]) @ w_out[e]`` as stacked weights, dropless, and the same all-to-alls
under ``ppswap.moe.expert_parallel``.

The routing decision (which experts, hence the split sizes) is made on the host from the
router's probabilities; the weights stay in the graph. ``AllToAllRows`` is a cell with a
custom ``bprop``: its backward sends the gradient rows back the other way (key
``{key}.grad``), so a dispatch's backward is a combine-shaped all-to-all and the other
way round.

MindSpore's PyNative autograd is not thread-safe and cannot record two forwards
interleaved, so a split block runs with one rank per process (MPI); ranks sharing one
process's compute thread cannot run it (``ppswap.core.fiber``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
from mindspore import Parameter, Tensor, nn, ops
from mindspore.common.initializer import Normal, initializer

from ppswap.core.all_to_all import AllToAll, LocalExchange

__all__ = ["AllToAllRows", "MoE"]

Counts = npt.NDArray[np.int64]


def _check_int(name: str, value: object, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be an int in {low}..{high}, got {value!r}")
    return value


def _exchange_rows(exchange: AllToAll, key: str, rows: Tensor, send: Counts) -> Tensor:
    host = rows.asnumpy()
    parts = [part.copy() for part in np.split(host, np.cumsum(send)[:-1])]
    return Tensor(np.concatenate(exchange.all_to_all(key, parts)))


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


class MoE(nn.Cell):  # type: ignore[misc]
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

    # -- compute ----------------------------------------------------------------------------
    def route(self, tokens: Tensor) -> tuple[npt.NDArray[np.int64], Tensor]:
        """Each token's ``top_k`` experts ``(T, k)`` (host) and their weights."""
        probs = ops.softmax(self.router(tokens), axis=-1)
        order = np.argsort(-probs.asnumpy(), axis=-1, kind="stable")
        picked = order[:, : self.top_k].astype(np.int64)
        weights = ops.gather_elements(probs, 1, Tensor(picked))
        return picked, weights / weights.sum(axis=-1, keepdims=True)

    def construct(self, x: Tensor) -> Tensor:
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
        experts = picked.reshape(-1)
        by_expert = np.argsort(experts, kind="stable")
        counts = np.bincount(experts, minlength=self._num_experts).astype(np.int64)
        send_counts = counts.reshape(members, local)
        recv_counts = np.stack(exchange.all_to_all(f"{key}.counts", list(send_counts)))
        recv_counts = recv_counts.reshape(members, local)
        send, recv = send_counts.sum(axis=1), recv_counts.sum(axis=1)
        rows = ops.gather(tokens, Tensor(by_expert // k), 0)
        received = AllToAllRows(exchange, f"{key}.dispatch", send, recv)(rows)
        done = self._run_experts(received, recv_counts)
        back = AllToAllRows(exchange, f"{key}.combine", recv, send)(done)
        unsort = np.empty_like(by_expert)
        unsort[by_expert] = np.arange(by_expert.size)
        per_pick = ops.gather(back, Tensor(unsort), 0).reshape(-1, k, self.dim)
        per_pick = per_pick * weights.expand_dims(-1)
        out = per_pick[:, 0]
        for slot in range(1, k):
            out = out + per_pick[:, slot]
        result: Tensor = out.reshape(x.shape)
        return result

    def _run_experts(self, rows: Tensor, counts: Counts) -> Tensor:
        """The kept experts on ``rows`` (from each member, its rows of each kept expert in
        turn), in the same order."""
        starts = np.concatenate([[0], np.cumsum(counts.reshape(-1))[:-1]]).reshape(counts.shape)
        by_expert = np.concatenate(
            [
                np.arange(starts[m, e], starts[m, e] + counts[m, e])
                for e in range(counts.shape[1])
                for m in range(counts.shape[0])
            ]
            + [np.zeros(0, dtype=np.int64)]
        ).astype(np.int64)
        grouped = ops.gather(rows, Tensor(by_expert), 0)
        outputs: list[Any] = []
        offset = 0
        for e, size in enumerate(counts.sum(axis=0).tolist()):
            part = grouped[offset : offset + size]
            outputs.append(ops.matmul(ops.silu(ops.matmul(part, self.w_in[e])), self.w_out[e]))
            offset += size
        done = ops.cat(outputs)
        unsort = np.empty_like(by_expert)
        unsort[by_expert] = np.arange(by_expert.size)
        result: Tensor = ops.gather(done, Tensor(unsort), 0)
        return result
