"""The demo LM's sizes, shared by its MindSpore (``ppswap.demo.model``) and torch
(``ppswap.demo.model_torch``) versions; imports no framework."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LMConfig"]


@dataclass(frozen=True, slots=True)
class LMConfig:
    """Vocabulary, sequence length, width, attention heads, transformer blocks per
    stage, and the seed the weights are drawn from."""

    vocab: int = 64
    seq: int = 32
    dim: int = 64
    heads: int = 4
    layers_per_stage: int = 1
    seed: int = 0
