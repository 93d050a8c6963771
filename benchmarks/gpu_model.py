"""The model ``gpu_check.py`` measures: a GPT-like pipeline of ``swap_wrapper``-ed
transformer blocks, its sizes (``PRESETS``), and how every model runs (``Settings``).

Sizing (fp32 parameters and activations, IEEE fp32 matmuls:
``torch.set_float32_matmul_precision("highest")``, torch's default):

- Saved per token per block ~17 d floats: the block input, both norms' outputs, qkv (3d),
  the attention output and its contiguous copy, the residual sum, the MLP's 4d input of
  GELU and 4d output: 68 d bytes. A chunk (one stage, one micro-batch) is 2 blocks.
- Whether swap can hide at all is a roofline: a chunk's forward must outlast its offload
  and its backward its load (one copy stream). Per token per block the forward is about
  24 d^2 + 2 s d FLOP, the copy 68 d bytes each way. At H100 / H200 rates (one GH100
  chip: fp32 SIMT ~50 TFLOPS achieved of 67 peak; pinned PCIe Gen5 ~50 GB/s each way) the
  forward covers its offload once 24 d + 2 s > 68 d * 1000, roughly d > 2500 at s = 2048.
- ``wide`` (the primary): d 4096, 32 heads (head dim 128), seq 2048, 1 sequence per
  micro-batch, vocab 8192. Forward per token-block ~420 MFLOP = 8.4 us against an offload
  of 272 KiB = 5.6 us (1.5x margin; the backward 3x). A chunk is ~1.06 GiB; GPipe holds all
  32 chunks at its peak without swap (~34 GiB) beside ~13 GB of parameters and gradients
  (8 x 12 d^2 x 4 B each) and the last stage's log-probs (0.5 GiB): ~47 GiB, activations
  about 3/4 of it. The plan keeps at most 12 of the 32 chunks resident with swap (every
  chunk eligible): ~27 GiB, a cut of ~20 GiB. ~170 TFLOP per step: ~3.5 s; about 17 steps
  in all plus copies and pinned allocation: ~1.5 min.
- ``narrow`` (a control, the brief's first guess): d 1024, 8 heads, seq 2048, 4 sequences
  per micro-batch: the same ~34 GiB of activations (~37 GiB peak without swap, ~16 GiB
  planned with swap) at 1/16 of the compute per token but 1/4 of the bytes: the forward
  (0.6 us per token-block) is ~2.5x shorter than its offload (1.4 us), so the copies
  cannot hide there and the step-time target is expected to FAIL; it shows the memory cut
  and the cost of exposed copies. ~1 s per step without swap: ~0.5 min.
- bfloat16 or TF32 cut the bytes 2x but the compute time 4-15x: copy-bound at these
  widths, hence fp32 by default (``--dtype bfloat16`` is there, on CPU too; a bfloat16
  tensor's host array is ``ml_dtypes``' bfloat16, which the GPU machine's image has).
  ``--autocast`` keeps fp32 weights and runs every pipeline step and unsplit step under
  ``torch.autocast`` to bfloat16 (mixed precision, as most training runs: the run reads
  the caller's autocast and its forwards run under it, ``ppswap/backends/torch/caller.py``).
- Host memory: swap keeps up to 20 chunks on the host (~21 GiB pinned, the pool is
  cleared before the unsplit runs) and ``save_on_cpu`` every saved tensor (~36 GiB pinned;
  torch's pinned cache reuses the same power-of-two blocks): well inside 128 GiB.
- ``tiny`` (CPU): d 32, 2 heads, seq 16, 2 sequences per micro-batch: a few seconds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F
from torch import nn

from ppswap.swap import swap_wrapper

__all__ = [
    "DTYPES",
    "PRESETS",
    "Block",
    "ModelSize",
    "OnDevice",
    "Settings",
    "StageModule",
    "Tokens",
    "build_modules",
    "lm_loss",
    "make_batch",
]

Tokens = npt.NDArray[np.int64]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
"""``--dtype``: the parameters' and activations' dtype by name."""


# -- the model -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    """A GPT-like model and its pipeline: ``pp`` stages of ``blocks_per_stage`` blocks,
    ``micro`` micro-batches of ``micro_batch`` sequences of ``seq`` tokens."""

    name: str
    dim: int
    heads: int
    seq: int
    vocab: int
    micro_batch: int
    blocks_per_stage: int = 2
    pp: int = 4
    micro: int = 8

    def __post_init__(self) -> None:
        for name in ("dim", "heads", "seq", "vocab", "micro_batch", "blocks_per_stage"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.pp < 2 or self.micro < 1:
            raise ValueError(f"pp must be >= 2 and micro >= 1, got pp={self.pp} micro={self.micro}")
        if self.dim % self.heads:
            raise ValueError(
                f"dim must be divisible by heads, got dim={self.dim} heads={self.heads}"
            )

    @property
    def batch(self) -> int:
        """Sequences per step (all micro-batches): the unsplit model's batch."""
        return self.micro * self.micro_batch

    @property
    def blocks(self) -> int:
        return self.pp * self.blocks_per_stage

    def flops_per_step(self) -> float:
        """Forward + backward FLOP of one step (3x the forward): matmuls of the blocks and
        the head, causal attention at half the square."""
        d, s = self.dim, self.seq
        per_token_block = 24 * d * d + 2 * s * d
        per_token_head = 2 * d * self.vocab
        tokens = self.batch * s
        return 3.0 * tokens * (self.blocks * per_token_block + per_token_head)

    def describe(self) -> str:
        return (
            f"{self.name}: dim {self.dim}, {self.heads} heads, seq {self.seq}, vocab "
            f"{self.vocab}, {self.blocks_per_stage} blocks/stage, pp {self.pp}, {self.micro} "
            f"micro-batches of {self.micro_batch} (batch {self.batch}), GPipe"
        )


PRESETS: dict[str, ModelSize] = {
    "wide": ModelSize("wide", dim=4096, heads=32, seq=2048, vocab=8192, micro_batch=1),
    "narrow": ModelSize("narrow", dim=1024, heads=8, seq=2048, vocab=8192, micro_batch=4),
    "tiny": ModelSize("tiny", dim=32, heads=2, seq=16, vocab=64, micro_batch=2),
}
"""The model sizes ``--models`` chooses from (module docstring: why these)."""


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention then a 4x GELU MLP, residuals."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        qkv = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, dim // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, seq, dim))
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out


@dataclass(frozen=True)
class OnDevice:
    """``swap_wrapper``'s ``policy_fn`` for ``--select device``: a saved tensor is selected
    for swap only when it lives on ``device`` (ppswap itself leaves a tensor the CUDA
    engine cannot move, such as the 0-d CPU philox seed and offset fused attention saves,
    where it is: this is for comparing the two)."""

    device: torch.device

    def __call__(self, tensor: torch.Tensor) -> bool:
        return tensor.device == self.device


class StageModule(nn.Module):
    """One pipeline stage: the embedding on the first, ``blocks`` wrapped blocks, the final
    norm and LM head on the last. The swap wrapper is transparent outside a pipeline run,
    so the stages chained are the unsplit model. ``policy``: the wrappers' ``policy_fn``."""

    def __init__(
        self,
        size: ModelSize,
        *,
        first: bool,
        last: bool,
        policy: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        super().__init__()
        self.tokens = nn.Embedding(size.vocab, size.dim) if first else None
        self.positions = nn.Embedding(size.seq, size.dim) if first else None
        self.blocks = nn.ModuleList(
            swap_wrapper(Block(size.dim, size.heads), policy_fn=policy)
            for _ in range(size.blocks_per_stage)
        )
        self.norm = nn.LayerNorm(size.dim) if last else None
        self.head = nn.Linear(size.dim, size.vocab, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tokens is not None and self.positions is not None:
            where = torch.arange(x.shape[1], device=x.device)
            x = self.tokens(x) + self.positions(where)
        for block in self.blocks:
            x = block(x)
        if self.norm is not None and self.head is not None:
            x = self.head(self.norm(x))
        return x


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@dataclass(frozen=True)
class Settings:
    """How every model runs: device, dtype, measured steps, which saved tensors swap may
    select (``"device"``: those on the device, ``"all"``: ppswap's default), the memory
    target's tolerance, and whether every step runs under autocast to bfloat16."""

    device: torch.device
    dtype: torch.dtype = torch.float32
    steps: int = 3
    select: str = "all"
    tolerance: float = 0.10
    autocast: bool = False

    def policy(self) -> Callable[[torch.Tensor], bool] | None:
        return OnDevice(self.device) if self.select == "device" else None

    def mixed(self) -> contextlib.AbstractContextManager[Any]:
        """Where each step runs: under ``torch.autocast`` to bfloat16 (``--autocast``)."""
        if self.autocast:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


def build_modules(size: ModelSize, settings: Settings) -> list[nn.Module]:
    """The stage modules, seeded, made directly on the device."""
    torch.manual_seed(0)
    with settings.device:
        modules = [
            StageModule(size, first=index == 0, last=index == size.pp - 1, policy=settings.policy())
            for index in range(size.pp)
        ]
    return [module.to(settings.dtype) for module in modules]


def make_batch(size: ModelSize) -> tuple[Tokens, Tokens]:
    """Random token ids and next-token targets for one step (host arrays)."""
    rng = np.random.default_rng(0)
    shape = (size.batch, size.seq)
    tokens: Tokens = rng.integers(0, size.vocab, shape, dtype=np.int64)
    targets: Tokens = rng.integers(0, size.vocab, shape, dtype=np.int64)
    return tokens, targets
