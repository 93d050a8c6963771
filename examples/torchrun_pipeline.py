"""A torch pipeline with one process per rank, over torch.distributed, under torchrun.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_pipeline.py

Needs torch (``pip install -e '.[torch]'``); without it, it exits with one line saying so.

A small torch network of eight residual MLP blocks is cut into eight pipeline stages
(the input projection on the first, the head on the last), every block wrapped with
``swap_wrapper``. Every process builds all of them from one seed and keeps its own: stage
``s`` runs on rank ``s % N`` of the ``N`` processes, so ``pp`` is the world size and each
rank runs ``8 / N`` virtual stages of Interleaved 1F1B (``N`` of 2 or 4). The transport
is ``TorchDistTransport`` (gloo; it initializes torch.distributed from torchrun's
environment). Three steps train with swap on and ``torch.optim.SGD`` on each process's own
parameters (a run leaves its gradients in their ``.grad``). Rank 0 prints every step's
loss (every process gets the losses back); every rank prints what swap moved there. A
world size that does not divide the eight stages is refused before anything runs, on
every rank, in one line naming ``--nproc-per-node``; the exit status is then 2.
"""

from __future__ import annotations

import asyncio
import sys
from typing import TextIO

from ppswap import PipelineStage, run_schedule
from ppswap.swap import swap_wrapper

try:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from ppswap.backends.torch.distributed import TorchDistTransport
except ModuleNotFoundError as missing:
    if missing.name != "torch":
        raise
    sys.exit(
        "examples/torchrun_pipeline.py runs on torch, which is not installed: "
        "pip install -e '.[torch]' in the ppswap checkout"
    )

STAGES = 8  # pipeline stages, spread over the processes: stage s on rank s % N
MICRO = 8  # micro-batches per step, a multiple of N
STEPS = 3
BATCH = 32
FEATURES, DIM, OUTPUTS = 16, 64, 4
LR = 0.05
TIMEOUT_S = 120.0  # every torch.distributed operation's deadline


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


def build_stages() -> list[nn.Sequential]:
    """``STAGES`` stage modules, the same weights in every process (one seed): a
    swap-wrapped block each, the input projection first, the head last."""
    torch.manual_seed(0)
    stages = []
    for index in range(STAGES):
        layers: list[nn.Module] = [swap_wrapper(Block(DIM))]
        if index == 0:
            layers.insert(0, nn.Linear(FEATURES, DIM))
        if index == STAGES - 1:
            layers.append(nn.Linear(DIM, OUTPUTS))
        stages.append(nn.Sequential(*layers))
    return stages


def say(line: str, stream: TextIO = sys.stdout) -> None:
    """Write ``line`` in one write: every rank shares the terminal, so a line written in
    pieces (``print`` writes its end apart when unbuffered) could be split by another's."""
    stream.write(f"{line}\n")
    stream.flush()


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression task: targets from a random teacher (the same in every process)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, FEATURES, generator=generator)
    teacher = torch.randn(FEATURES, OUTPUTS, generator=generator)
    return x, torch.tanh(x @ teacher)


async def train(transport: TorchDistTransport) -> int:
    rank, world = transport.rank, transport.world_size
    mine = [
        PipelineStage(module, index, STAGES)
        for index, module in enumerate(build_stages())
        if index % world == rank
    ]
    optimizer = torch.optim.SGD([p for stage in mine for p in stage.parameters], lr=LR)
    x, y = make_data()
    for step in range(1, STEPS + 1):
        try:
            result = await run_schedule(
                mine,
                "interleaved_1f1b",
                micro_batch_num=MICRO,
                inputs=x,
                targets=y,
                loss_fn=F.mse_loss,
                swap=True,
                transport=transport,
            )
        except ValueError as exc:  # a bad configuration, refused before anything ran
            say(f"rank {rank}: error: {exc}", sys.stderr)
            return 2
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            say(f"step {step}: loss {result.loss:.6f}")
    stats = result.ranks[rank]
    say(
        f"rank {rank}: stages {[stage.stage_index for stage in mine]}, peak saved "
        f"{stats.peak_saved_bytes} B, offloaded {stats.offloaded_bytes} B"
    )
    return 0


def main() -> int:
    with TorchDistTransport(timeout_s=TIMEOUT_S) as transport:
        return asyncio.run(train(transport))


if __name__ == "__main__":
    sys.exit(main())
