"""A small character-level transformer language model, cut into pipeline stages.

Used by ``ppswap demo``, the examples, the tests and the benchmarks. Every stage holds
``layers_per_stage`` transformer blocks; stage 0 also embeds the tokens and the last stage
projects to the vocabulary. The causal mask is one tensor shared by every block of a stage
(like a rotary table): it must never be offloaded or freed. Beside it, small MLP stages
for tests: ``build_mlp_stages``, and ``build_tuple_stages`` (stages that pass a tuple of
tensors on).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mindspore as ms
import numpy as np
import numpy.typing as npt
from mindspore import Tensor, nn, ops

from ppswap.demo.config import LMConfig

__all__ = [
    "LMConfig",
    "TransformerBlock",
    "build_lm_stages",
    "build_lm_unsplit",
    "build_mlp_stages",
    "cross_entropy_loss",
    "mse_loss",
    "unsplit_loss_and_grads",
]


class TransformerBlock(nn.Cell):  # type: ignore[misc]
    """Pre-norm block: causal multi-head self-attention, then a GELU MLP."""

    def __init__(self, dim: int, heads: int, mask: Tensor) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.norm1 = nn.LayerNorm((dim,))
        self.qkv = nn.Dense(dim, 3 * dim)
        self.proj = nn.Dense(dim, dim)
        self.norm2 = nn.LayerNorm((dim,))
        self.fc1 = nn.Dense(dim, 4 * dim)
        self.fc2 = nn.Dense(4 * dim, dim)
        self.mask = mask  # shared by every block of the stage: an alias to protect
        self.scale = float(self.head_dim) ** -0.5

    def construct(self, x: Tensor) -> Tensor:
        batch, seq, dim = x.shape
        h = self.norm1(x)
        qkv = self.qkv(h).reshape(batch, seq, 3, self.heads, self.head_dim)
        qkv = qkv.transpose(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = ops.matmul(q, k.swapaxes(-1, -2)) * self.scale
        scores = scores + self.mask[:seq, :seq]
        attn = ops.softmax(scores, axis=-1)
        out = ops.matmul(attn, v).transpose(0, 2, 1, 3).reshape(batch, seq, dim)
        x = x + self.proj(out)
        x = x + self.fc2(ops.gelu(self.fc1(self.norm2(x))))
        return x


class LMStage(nn.Cell):  # type: ignore[misc]
    """One pipeline stage of the LM: [embedding] + blocks + [norm + head]."""

    def __init__(self, cfg: LMConfig, *, first: bool, last: bool, mask: Tensor) -> None:
        super().__init__()
        self.first = first
        self.last = last
        self.embed = nn.Embedding(cfg.vocab, cfg.dim) if first else None
        self.pos = (
            ms.Parameter(Tensor(np.zeros((1, cfg.seq, cfg.dim), np.float32)), name="pos")
            if first
            else None
        )
        self.layers = nn.CellList(
            [TransformerBlock(cfg.dim, cfg.heads, mask) for _ in range(cfg.layers_per_stage)]
        )
        self.norm = nn.LayerNorm((cfg.dim,)) if last else None
        self.head = nn.Dense(cfg.dim, cfg.vocab) if last else None

    def construct(self, x: Tensor) -> Tensor:
        if self.embed is not None and self.pos is not None:
            x = self.embed(x) + self.pos
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def _causal_mask(seq: int) -> Tensor:
    mask = np.triu(np.full((seq, seq), -1e9, np.float32), k=1)
    return Tensor(mask)


def build_lm_stages(cfg: LMConfig, stage_num: int) -> list[nn.Cell]:
    """``stage_num`` stage modules with deterministic weights (seeded by ``cfg.seed``)."""
    ms.set_seed(cfg.seed)
    np.random.seed(cfg.seed)
    mask = _causal_mask(cfg.seq)
    return [
        LMStage(cfg, first=i == 0, last=i == stage_num - 1, mask=mask) for i in range(stage_num)
    ]


class _Unsplit(nn.Cell):  # type: ignore[misc]
    def __init__(self, stages: list[nn.Cell]) -> None:
        super().__init__()
        self.stages = nn.CellList(stages)

    def construct(self, x: Tensor) -> Tensor:
        for stage in self.stages:
            x = stage(x)
        return x


def build_lm_unsplit(stages: list[nn.Cell]) -> nn.Cell:
    """The same stage modules chained into one model (the reference run)."""
    return _Unsplit(stages)


def cross_entropy_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross entropy over every position of the micro-batch."""
    vocab = logits.shape[-1]
    return ops.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1).astype(ms.int32))


LossCallable = Callable[[Tensor, Tensor], Tensor]


class MLPBlock(nn.Cell):  # type: ignore[misc]
    """Dense -> tanh -> Dense with a residual: a stage body with several saved tensors."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Dense(dim, 2 * dim)
        self.fc2 = nn.Dense(2 * dim, dim)

    def construct(self, x: Tensor) -> Tensor:
        return x + self.fc2(ops.tanh(self.fc1(x)))


def build_mlp_stages(
    stage_num: int,
    *,
    dim: int = 16,
    blocks_per_stage: int = 2,
    seed: int = 0,
    wrap: Callable[[nn.Cell], nn.Cell] | None = None,
) -> list[nn.Cell]:
    """``stage_num`` MLP stage modules with deterministic weights.

    ``wrap`` is applied to every block (``swap_wrapper`` in the swap tests), as a user
    wraps a model's layers.
    """
    ms.set_seed(seed)
    np.random.seed(seed)
    stages: list[nn.Cell] = []
    for _ in range(stage_num):
        blocks = [MLPBlock(dim) for _ in range(blocks_per_stage)]
        if wrap is not None:
            blocks = [wrap(block) for block in blocks]
        stages.append(nn.SequentialCell(blocks))
    return stages


class TupleStage(nn.Cell):  # type: ignore[misc]
    """An MLP stage that passes ``(hidden, mask, scale)`` on (several tensors between
    stages): the first takes the batch and makes an int32 ``mask`` (no gradient travels
    back for it) and a float ``scale``; each middle stage uses and changes ``scale``; the
    last returns one tensor."""

    def __init__(self, block: nn.Cell, *, first: bool, last: bool) -> None:
        super().__init__()
        self.block, self.first, self.last = block, first, last

    def construct(self, *args: Tensor) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        if self.first:
            hidden = self.block(args[0])
            mask = (args[0][:, :1] > -0.5).astype(ms.int32)
            return hidden, mask, ops.sigmoid(hidden.mean(-1, keep_dims=True))
        hidden, mask, scale = args
        if self.last:
            out: Tensor = self.block(hidden) * mask.astype(hidden.dtype) + scale
            return out
        hidden = self.block(hidden) * scale * mask.astype(hidden.dtype)
        return hidden, mask, scale * ops.tanh(hidden.mean(-1, keep_dims=True))


def build_tuple_stages(
    stage_num: int,
    *,
    dim: int = 16,
    seed: int = 0,
    wrap: Callable[[nn.Cell], nn.Cell] | None = None,
) -> list[nn.Cell]:
    """``stage_num`` (at least 2) :class:`TupleStage` modules of one ``MLPBlock`` each
    (``wrap``-ed, as ``build_mlp_stages``), with deterministic weights."""
    ms.set_seed(seed)
    np.random.seed(seed)
    blocks = [MLPBlock(dim) for _ in range(stage_num)]
    return [
        TupleStage(block if wrap is None else wrap(block), first=i == 0, last=i == stage_num - 1)
        for i, block in enumerate(blocks)
    ]


def mse_loss(output: Tensor, target: Tensor) -> Tensor:
    """Mean squared error over the micro-batch."""
    return ops.mean((output - target) ** 2)


def unsplit_loss_and_grads(
    modules: list[nn.Cell],
    inputs: npt.NDArray[Any],
    targets: npt.NDArray[Any],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
) -> tuple[float, list[list[npt.NDArray[Any]]]]:
    """The reference a pipeline run must match: the stage modules chained into one model,
    run on the whole batch; its loss and gradients grouped per stage (each group aligned
    with that stage's ``trainable_params()``).

    With equal micro-batches and a mean-reduced loss, the mean of the per-micro-batch
    losses equals this full-batch loss.
    """
    model = build_lm_unsplit(list(modules))
    x, y = Tensor(inputs), Tensor(targets)

    def full_loss() -> Tensor:
        return loss_fn(model(x), y)

    loss, vjp_fn = ms.vjp(full_loss, weights=model.trainable_params())
    _, grads = vjp_fn(Tensor(np.float32(1.0)))
    flat = [g.asnumpy() for g in grads]
    per_stage: list[list[npt.NDArray[Any]]] = []
    cursor = 0
    for module in modules:
        count = len(module.trainable_params())
        per_stage.append(flat[cursor : cursor + count])
        cursor += count
    return float(loss.asnumpy()), per_stage
