"""A GPT-2 style torch model whose head multiplies by the input embedding's weight, cut
into pipeline stages (tests of tied parameters, in one process and across processes).

Stage 0 embeds the tokens (``wte``) and runs a block; middle stages run a block; the last
runs a block and the head, ``hidden @ wte.weight.T``: with ``shared=True`` the very
``wte.weight`` object of stage 0, else a copy of it of its own (``head.weight``), which
the stages then declare tied (``TIED``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ppswap.swap import swap_wrapper

VOCAB, DIM, SEQ, BATCH = 11, 8, 5, 8
TIED = {0: {"wte.weight": "embedding"}, -1: {"head.weight": "embedding"}}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(torch.tanh(self.fc1(x)))
        return out


class First(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, DIM)
        self.block = swap_wrapper(Block())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.block(self.wte(tokens))
        return out


class Head(nn.Module):
    """``hidden @ weight.T``: the logits over the vocabulary (GPT-2's ``lm_head``)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


class Last(nn.Module):
    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.block = swap_wrapper(Block())
        self.head = Head(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(x))
        return out


def tied_modules(stage_num: int, *, shared: bool, seed: int = 0) -> list[nn.Module]:
    """The stages' modules, the same weights for a seed; ``shared``: the head holds stage
    0's ``wte.weight`` object, else a copy of it."""
    torch.manual_seed(seed)
    first = First()
    middle = [swap_wrapper(Block()) for _ in range(stage_num - 2)]
    weight = first.wte.weight if shared else nn.Parameter(first.wte.weight.detach().clone())
    return [first, *middle, Last(weight)]


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def tokens(seed: int = 1, batch: int = BATCH) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of token ids and its next-token targets."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=generator)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def unsplit(
    stage_num: int, seed: int = 0, batch: int = BATCH
) -> tuple[float, list[list[torch.Tensor]]]:
    """The unsplit model's loss and, per stage, its parameters' gradients (the tied
    weight's: the sum of both uses, as autograd makes it)."""
    modules = tied_modules(stage_num, shared=True, seed=seed)
    x, y = tokens(batch=batch)
    loss = lm_loss(nn.Sequential(*modules)(x), y)
    loss.backward()
    grads = []
    for module in modules:
        row = []
        for param in module.parameters():
            assert param.grad is not None
            row.append(param.grad)
        grads.append(row)
    return float(loss.detach()), grads
