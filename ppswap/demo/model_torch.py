"""The demo's character-level transformer LM in torch, cut into pipeline stages.

The torch twin of ``ppswap.demo.model`` (MindSpore): the same configuration
(``LMConfig``: the same fields and defaults) and the same structure. Every stage holds
``layers_per_stage`` pre-norm transformer blocks; stage 0 also embeds the tokens and adds
a learned positional parameter, the last stage applies a final norm and projects to the
vocabulary. The causal mask is one tensor shared by every block of a stage (like a rotary
table): it must never be offloaded or freed. Weights are deterministic from ``cfg.seed``;
they are torch's default initializations, not MindSpore's, so the two demos' numbers
differ.

Importing this module imports torch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ppswap.demo.config import LMConfig

__all__ = [
    "LMConfig",
    "LMStage",
    "TransformerBlock",
    "build_lm_stages",
    "cross_entropy_loss",
    "sgd_step",
]


class TransformerBlock(nn.Module):
    """Pre-norm block: causal multi-head self-attention, then a GELU MLP.

    ``mask`` is an additive ``(seq, seq)`` causal mask (``-1e9`` above the diagonal),
    held as a non-persistent buffer: the same tensor object in every block of a stage.
    """

    mask: torch.Tensor

    def __init__(self, dim: int, heads: int, mask: torch.Tensor) -> None:
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.register_buffer("mask", mask, persistent=False)  # shared: an alias to protect
        self.scale = float(self.head_dim) ** -0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        h = self.norm1(x)
        qkv = self.qkv(h).reshape(batch, seq, 3, self.heads, self.head_dim)
        # (3, batch * heads, seq, head_dim): the attention runs as 3-D bmm, so the softmax
        # output that the second bmm saves is the very view softmax saved. (A 4-D matmul
        # saves a reshaped view of it as well: the swap layer copies each saved view, so
        # that storage would move, and come back, twice.)
        qkv = qkv.permute(2, 0, 3, 1, 4).reshape(3, batch * self.heads, seq, self.head_dim)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = torch.bmm(q, k.transpose(-1, -2)) * self.scale
        scores = scores + self.mask[:seq, :seq]
        attn = torch.softmax(scores, dim=-1)
        out = torch.bmm(attn, v).reshape(batch, self.heads, seq, self.head_dim)
        out = out.permute(0, 2, 1, 3).reshape(batch, seq, dim)
        x = x + self.proj(out)
        x = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return x


class LMStage(nn.Module):
    """One pipeline stage of the LM: [embedding + positions] + blocks + [norm + head].

    The first stage takes token ids ``(batch, seq)`` (int32 or int64); the others take
    the previous stage's ``(batch, seq, dim)`` activations. The last stage returns logits
    ``(batch, seq, vocab)``.
    """

    def __init__(self, cfg: LMConfig, *, first: bool, last: bool, mask: torch.Tensor) -> None:
        super().__init__()
        self.first = first
        self.last = last
        self.embed = nn.Embedding(cfg.vocab, cfg.dim) if first else None
        self.pos = nn.Parameter(torch.zeros(1, cfg.seq, cfg.dim)) if first else None
        self.layers = nn.ModuleList(
            [TransformerBlock(cfg.dim, cfg.heads, mask) for _ in range(cfg.layers_per_stage)]
        )
        self.norm = nn.LayerNorm(cfg.dim) if last else None
        self.head = nn.Linear(cfg.dim, cfg.vocab) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None and self.pos is not None:
            x = self.embed(x) + self.pos
        for layer in self.layers:
            x = layer(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def _causal_mask(seq: int) -> torch.Tensor:
    return torch.triu(torch.full((seq, seq), -1e9, dtype=torch.float32), diagonal=1)


def build_lm_stages(cfg: LMConfig, stage_num: int) -> list[LMStage]:
    """``stage_num`` stage modules (on the CPU) with weights drawn from ``cfg.seed``.

    The same ``cfg`` gives the same weights on every call; torch's global random state is
    left as it was (the weights are drawn in a forked generator state).
    """
    if not isinstance(stage_num, int) or isinstance(stage_num, bool) or stage_num < 1:
        raise ValueError(f"stage_num must be an int >= 1, got {stage_num!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        stages: list[LMStage] = []
        for index in range(stage_num):
            mask = _causal_mask(cfg.seq)  # one per stage, shared by its blocks
            stages.append(LMStage(cfg, first=index == 0, last=index == stage_num - 1, mask=mask))
    return stages


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over every position of the micro-batch (a scalar).

    ``logits``: ``(..., vocab)``; ``targets``: the token ids of the same leading shape
    (any integer dtype).
    """
    vocab = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1).long())


def sgd_step(parameters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], lr: float) -> None:
    """Plain SGD in place: ``p -= lr * g`` for each parameter and its gradient (aligned,
    as ``PipelineStage.parameters`` and ``.grads``), then ``p.grad`` back to None (as an
    optimizer's ``zero_grad``: a run adds into a ``.grad`` it finds)."""
    with torch.no_grad():
        for param, grad in zip(parameters, grads, strict=True):
            param.sub_(lr * grad)
            param.grad = None
