"""A torch model through ppswap: cut into pipeline stages, blocks marked for swap, SGD.

    python examples/torch_pipeline.py

Needs torch (``pip install -e '.[torch]'``); without it, it exits with one line saying so.

One small torch network (an input projection, eight residual MLP blocks, a head) is cut
into four pipeline stages, one per rank; every block is wrapped with ``swap_wrapper`` (its
saved activations may move to host memory). It trains a few GPipe steps with swap off,
then again from the same weights with swap on, updating the weights with
``torch.optim.SGD`` (a run leaves its gradients in each parameter's ``.grad``, as
``loss.backward()`` does). Swap moves activations to the host and back; it changes no
number, so the losses must agree bit for bit (exit status 1 if they do not). Printed: the loss of
every step with swap off and on, then per rank the measured peak of the bytes autograd
saved for backward without and with swap, and how many bytes swap offloaded.
"""

from __future__ import annotations

import asyncio
import sys

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.swap import swap_wrapper

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ModuleNotFoundError as missing:
    if missing.name != "torch":
        raise
    sys.exit(
        "examples/torch_pipeline.py runs on torch, which is not installed: "
        "pip install -e '.[torch]' in the ppswap checkout "
        "(examples/module_swap.py is a MindSpore example)"
    )

PP = 4  # pipeline ranks, one stage each
MICRO = 8  # micro-batches per step
STEPS = 3
BATCH = 32
FEATURES, DIM, OUTPUTS, BLOCKS = 16, 128, 4, 8
LR = 0.05


class Block(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        return out


class Net(nn.Module):
    """The whole model, as one would write it without a pipeline."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        out: torch.Tensor = self.head(x)
        return out


def cut_into_stages(net: Net, pp: int) -> list[nn.Sequential]:
    """``pp`` stage modules holding ``net``'s own layers: the blocks split evenly, the
    input projection on the first stage, the head on the last; each block wrapped with
    ``swap_wrapper`` (the wrapper shares the block's parameters)."""
    per_stage = len(net.blocks) // pp
    stages: list[nn.Sequential] = []
    for index in range(pp):
        layers: list[nn.Module] = [
            swap_wrapper(block) for block in net.blocks[index * per_stage : (index + 1) * per_stage]
        ]
        if index == 0:
            layers.insert(0, net.embed)
        if index == pp - 1:
            layers.append(net.head)
        stages.append(nn.Sequential(*layers))
    return stages


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression task: targets from a random teacher."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, OUTPUTS, generator=generator)
    return x, torch.tanh(x @ teacher)


async def train(swap: bool) -> tuple[list[float], RunResult]:
    """``STEPS`` GPipe steps from the same initial weights; the losses and the last result."""
    torch.manual_seed(0)
    modules = cut_into_stages(Net(), PP)
    stages = [PipelineStage(module, index, PP) for index, module in enumerate(modules)]
    optimizer = torch.optim.SGD([p for stage in stages for p in stage.parameters], lr=LR)
    x, y = make_data()
    losses: list[float] = []
    result: RunResult | None = None
    for _ in range(STEPS):
        result = await run_schedule(
            stages,
            "gpipe",
            micro_batch_num=MICRO,
            inputs=x,
            targets=y,
            loss_fn=F.mse_loss,
            swap=swap,
        )
        losses.append(result.loss)
        optimizer.step()  # the run left the mean loss's gradients in each .grad
        optimizer.zero_grad()
    assert result is not None
    return losses, result


async def main() -> int:
    losses_off, off = await train(swap=False)
    losses_on, on = await train(swap=True)
    for step, (loss_off, loss_on) in enumerate(zip(losses_off, losses_on, strict=True), 1):
        print(f"step {step}: loss swap off {loss_off:.6f}, swap on {loss_on:.6f}")
    same = losses_off == losses_on
    print(f"bit-identical: {'yes' if same else 'NO'}")
    for rank_off, rank_on in zip(off.ranks, on.ranks, strict=True):
        cut = 1 - rank_on.peak_saved_bytes / rank_off.peak_saved_bytes
        print(
            f"rank {rank_off.rank}: peak saved {rank_off.peak_saved_bytes} B without swap, "
            f"{rank_on.peak_saved_bytes} B with swap ({cut:.0%} less), "
            f"offloaded {rank_on.offloaded_bytes} B"
        )
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
