"""A mixture-of-experts pipeline: PP=4 x EP=2, 1F1B with overlap_b_f and swap, on torch.

    python examples/moe_pipeline.py                                    # eight ranks here
    torchrun --standalone --nproc-per-node 8 examples/moe_pipeline.py  # one per process

Needs torch (``pip install -e '.[torch]'``); without it, it exits with one line saying so.

Four pipeline stages, each a swap-wrapped dense residual block then a swap-wrapped
residual ``MoE`` block (four experts, top-2), on the mesh ``DeviceMesh(pp=4, dp=2,
ep=2)``: each stage has two replicas, and each replica keeps two of every MoE block's
four experts (``expert_parallel``) and a shard of the dense parameters (``fully_shard``);
tokens reach the other experts by all-to-all over the EP group. Run as a plain script,
all eight ranks run in this process (in-process transport); under torchrun (the
environment has ``WORLD_SIZE``), world rank ``w`` is pipeline rank ``w % 4`` of replica
``w // 4`` over ``TorchDistTransport`` (gloo), and the world size must be 8. Three steps
train the global batch with plain SGD on each rank's own shards and experts (a run leaves
their gradients in ``PipelineStage.grads``); every step's loss is printed (by rank 0
under torchrun), then each rank's peak of saved activation bytes and what swap moved.
"""

from __future__ import annotations

import asyncio
import os
import sys

from ppswap import DeviceMesh, PipelineStage, expert_parallel, fully_shard, run_schedule
from ppswap.swap import swap_wrapper

try:
    import torch
    import torch.nn.functional as F
    from torch import nn

    from ppswap.backends.torch.distributed import TorchDistTransport
    from ppswap.backends.torch.moe import MoE
except ModuleNotFoundError as missing:
    if missing.name != "torch":
        raise
    sys.exit(
        "examples/moe_pipeline.py runs on torch, which is not installed: "
        "pip install -e '.[torch]' in the ppswap checkout"
    )

MESH = DeviceMesh(pp=4, dp=2, ep=2)
MICRO = 8  # micro-batches per replica and step
STEPS = 3
BATCH, SEQ, DIM = 32, 4, 16  # the global batch: BATCH sequences of SEQ tokens
EXPERTS, TOP_K = 4, 2
LR = 0.1
TIMEOUT_S = 120.0  # every step's deadline, and every torch.distributed operation's


class Residual(nn.Module):
    """``x + body(x)``."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.body(x)
        return out


def build_stages() -> list[nn.Sequential]:
    """The four stage modules, the same weights wherever they are built (one seed)."""
    torch.manual_seed(0)
    return [
        nn.Sequential(
            swap_wrapper(
                Residual(nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.Tanh(), nn.Linear(4 * DIM, DIM)))
            ),
            swap_wrapper(Residual(MoE(DIM, 2 * DIM, EXPERTS, top_k=TOP_K))),
        )
        for _ in range(MESH.pp)
    ]


def split_stage(module: nn.Module, index: int, dp_rank: int) -> PipelineStage:
    """Replica ``dp_rank`` of stage ``index``: its experts kept, its dense params sharded."""
    expert_parallel(module, mesh=MESH, dp_rank=dp_rank)
    fully_shard(module, mesh=MESH, dp_rank=dp_rank)
    return PipelineStage(module, index, MESH.pp)


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed regression task: targets from a random teacher (the same everywhere)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, SEQ, DIM, generator=generator)
    teacher = torch.randn(DIM, DIM, generator=generator) / DIM**0.5
    return x, torch.tanh(x @ teacher)


def sgd_step(stages: list[PipelineStage]) -> None:
    """``p -= LR * grad`` on each stage's own parameters (its shards and experts)."""
    with torch.no_grad():
        for stage in stages:
            for param, grad in zip(stage.parameters, stage.grads, strict=True):
                param.sub_(LR * grad)


async def train(stages: list[PipelineStage], transport: TorchDistTransport | None) -> None:
    """``STEPS`` steps over ``stages`` (every rank's, or this process's one)."""
    x, y = make_data()
    talk = transport is None or transport.rank == 0
    for step in range(1, STEPS + 1):
        result = await run_schedule(
            stages,
            "1f1b",
            overlap_b_f=True,
            micro_batch_num=MICRO,
            inputs=x,
            targets=y,
            loss_fn=F.mse_loss,
            swap=True,
            min_swap_gap=2,
            pp=MESH.pp,
            transport=transport,
            step_timeout=TIMEOUT_S,
        )
        sgd_step(stages)
        if talk:
            print(f"step {step}: loss {result.loss:.6f}", flush=True)
    for stats in result.ranks:
        if transport is None or stats.rank == transport.rank:
            print(
                f"rank {stats.rank}: peak saved {stats.peak_saved_bytes} B, "
                f"offloaded {stats.offloaded_bytes} B",
                flush=True,
            )


def main() -> int:
    if "WORLD_SIZE" not in os.environ:
        stages = [
            split_stage(module, index, dp_rank)
            for dp_rank in range(MESH.dp)
            for index, module in enumerate(build_stages())
        ]
        asyncio.run(train(stages, None))
        return 0
    if int(os.environ["WORLD_SIZE"]) != MESH.world_size:
        print(
            f"error: --nproc-per-node must be {MESH.world_size} (pp=4 x dp=2), "
            f"got a world of {os.environ['WORLD_SIZE']}",
            file=sys.stderr,
        )
        return 2
    with TorchDistTransport(timeout_s=TIMEOUT_S) as transport:
        coords = MESH.coords(transport.rank)
        stage = split_stage(build_stages()[coords.pp], coords.pp, coords.dp)
        asyncio.run(train([stage], transport))
    return 0


if __name__ == "__main__":
    sys.exit(main())
