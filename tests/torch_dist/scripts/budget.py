"""One rank of a torch pipeline under memory_budget over TorchDistTransport (``torchrun
--nproc_per_node N``) or MPITransport (``mpiexec -n N``):

    budget.py torch|mpi CASE [CASE ...]

The stages' blocks (``x + fc2(dropout(tanh(fc1(x))))``, dropout 0.2) are wrapped by
``recompute_wrapper`` and ``swap_wrapper``; torch is seeded alike before every run (the
masks come from each stage's own stream, the same in every process layout). The cases,
the calibration, the budgets and the checks are ``tests/budget_checks.py``'s.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: budget_checks
from budget_checks import Case, Grads, check_cases, chosen_cases

from ppswap import PipelineStage, RunResult, recompute_wrapper, run_schedule
from ppswap.backends.torch.distributed import TorchDistTransport
from ppswap.swap import swap_wrapper

DIM, SEQ, SAMPLES = 16, 8, 2
DROPOUT_SEED = 1234


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.fc2(self.drop(torch.tanh(self.fc1(x))))
        return out


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def modules(stage_num: int) -> list[nn.Module]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return [
            nn.Sequential(*(recompute_wrapper(swap_wrapper(Block())) for _ in range(2)))
            for _ in range(stage_num)
        ]


async def run(case: Case, world: int, transport: Any, **options: Any) -> tuple[RunResult, Grads]:
    """``case`` over ``transport`` (this rank's stages) or in this process (None)."""
    stage_num, micro = case.stage_num(world), case.micro(world)
    stages = [
        PipelineStage(m, i, stage_num)
        for i, m in enumerate(modules(stage_num))
        if transport is None or i % world == transport.rank
    ]
    rng = np.random.default_rng(1)
    x = torch.from_numpy(rng.standard_normal((SAMPLES * micro, SEQ, DIM)).astype(np.float32))
    y = torch.from_numpy(rng.standard_normal((SAMPLES * micro, SEQ, DIM)).astype(np.float32))
    torch.manual_seed(DROPOUT_SEED)
    result = await run_schedule(
        stages,
        case.schedule,
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse,
        pp=world,
        transport=transport,
        step_timeout=60.0,
        **case.options,
        **options,
    )
    grads = {s.stage_index: [g.detach().numpy().copy() for g in s.grads] for s in stages}
    return result, grads


if __name__ == "__main__":
    usage = "budget.py torch|mpi CASE [CASE ...]"
    if len(sys.argv) < 2 or sys.argv[1] not in ("torch", "mpi"):
        raise SystemExit(f"usage: {usage}")
    kind, cases = sys.argv[1], chosen_cases(sys.argv[2:], usage)
    torch.set_num_threads(1)
    transport: Any
    if kind == "mpi":
        from ppswap.transports.mpi import MPITransport

        transport = MPITransport()
    else:
        transport = TorchDistTransport(timeout_s=120)
    check_cases(run, transport, cases)
