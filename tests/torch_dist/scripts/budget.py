"""One rank of a torch pipeline under memory_budget over TorchDistTransport (``torchrun
--nproc_per_node N``) or MPITransport (``mpiexec -n N``):

    budget.py torch|mpi CASE [CASE ...]

A case is ``gpipe``, ``1f1b``, ``1f1b-overlap`` or ``interleaved`` (vpp 2): pp = N ranks,
2 * N micro-batches. The stages' blocks (``x + fc2(dropout(tanh(fc1(x))))``, dropout 0.2)
are wrapped by ``recompute_wrapper`` and ``swap_wrapper``; torch is seeded alike before
every run (the masks come from each stage's own stream, the same in every process layout).

Every process builds all stages from one seed and runs three calibration steps of the
whole pipeline in this process (keep everything, the gap rule's swap, recompute
everything): ``CostModel.from_result`` of them, with fixed times (so every process plans
alike whatever its measured times), and the budgets: per rank half its keep-everything
peak (not below the planner's least) and recompute-everything's peak. Then, per budget,
the run over the transport (this rank's stages). Per case, budget and rank it checks:

1. this rank's measured peak of saved bytes is within its budget, and its chunk policies
   are those of the same budget's plan in this process;
2. losses and this rank's gradients are bit-identical to the keep-everything run in this
   process;
3. on rank 0 only: every rank's gradients (all-gathered over the transport) are
   bit-identical to the same budget's run in this process, and some rank's plan is not
   keep-only (the budget binds).

It prints ``rank R case NAME BUDGET OK peak=P budget=B policies=...`` per passed check
and ``rank R case NAME BUDGET MISMATCH: ...`` per failed one; after the last case every
rank exits 1 if any rank found a mismatch.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, replace
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt
import torch
from torch import nn

from ppswap import PipelineStage, RunResult, recompute_wrapper, run_schedule
from ppswap.backends.torch.distributed import TorchDistTransport
from ppswap.scheduler.budget import least_budgets
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel
from ppswap.swap import swap_wrapper

Array = npt.NDArray[Any]
DIM, SEQ, SAMPLES = 16, 8, 2
DROPOUT_SEED = 1234
CASES = {
    "gpipe": ("gpipe", 1, {}),
    "1f1b": ("1f1b", 1, {}),
    "1f1b-overlap": ("1f1b", 1, {"overlap_b_f": True}),
    "interleaved": ("interleaved_1f1b", 2, {}),
}
"""Per case: the schedule, stages per rank and its other options."""


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


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str
    vpp: int
    options: dict[str, Any]

    def stage_num(self, world: int) -> int:
        return world * self.vpp

    def micro(self, world: int) -> int:
        return 2 * world


def modules(stage_num: int) -> list[nn.Module]:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return [
            nn.Sequential(*(recompute_wrapper(swap_wrapper(Block())) for _ in range(2)))
            for _ in range(stage_num)
        ]


async def run(
    case: Case, world: int, transport: Any, **options: Any
) -> tuple[RunResult, dict[int, list[Array]]]:
    """The case over ``transport`` (this rank's stages) or in this process (None)."""
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


def peaks(result: RunResult) -> list[int]:
    return [rank.peak_saved_bytes for rank in result.ranks]


async def plan_inputs(case: Case, world: int) -> tuple[CostModel, dict[str, list[int]]]:
    """The cost model and the budgets (module docstring), from runs in this process."""
    keep, _ = await run(case, world, None)
    swap, _ = await run(case, world, None, swap=True)
    recompute, _ = await run(case, world, None, recompute=True)
    measured = CostModel.from_result(keep, swap, recompute)
    model = replace(
        measured,
        leaf_s=1e-3,
        backward_leaf_s=2e-3,
        recompute_leaf_s=1e-3,
        swap_step_s=1e-4,
        d2h_gbps=1.0,
        h2d_gbps=1.0,
    )
    config = ScheduleConfig(
        schedule=case.schedule,  # type: ignore[arg-type]
        pp=world,
        vpp=case.vpp,
        micro=case.micro(world),
        swap=True,
        overlap_b_f=bool(case.options.get("overlap_b_f")),
    )
    least = least_budgets(config, model, frozenset(range(case.stage_num(world))))
    budgets = {
        "50%": [max(p // 2, q) for p, q in zip(peaks(keep), least, strict=True)],
        "recompute-all": [max(p, q) for p, q in zip(peaks(recompute), least, strict=True)],
    }
    return model, budgets


def flat(grads: dict[int, list[Array]], world: int, rank: int) -> Array:
    parts = [
        g.reshape(-1).view(np.uint8) for i in sorted(grads) if i % world == rank for g in grads[i]
    ]
    return np.concatenate(parts)


def say(line: str) -> None:
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


async def check_case(transport: Any, case: Case) -> bool:
    rank, world = transport.rank, transport.world_size
    model, budgets = await plan_inputs(case, world)
    keep, keep_grads = await run(case, world, None)
    failed = False
    for label, budget in budgets.items():
        options = dict(swap=True, memory_budget=dict(enumerate(budget)), cost_model=model)
        result, grads = await run(case, world, transport, **options)
        local, local_grads = await run(case, world, None, **options)
        mine = result.ranks[rank]
        found = []
        if mine.peak_saved_bytes > budget[rank]:
            found.append(f"peak {mine.peak_saved_bytes} over the budget {budget[rank]}")
        if mine.chunk_policy != local.ranks[rank].chunk_policy:
            found.append(
                f"policies {mine.chunk_policy} != in-process {local.ranks[rank].chunk_policy}"
            )
        if np.array(result.losses).tobytes() != np.array(keep.losses).tobytes():
            found.append(f"losses {result.losses} != keep-everything {keep.losses}")
        for index, stage_grads in grads.items():
            for k, (got, want) in enumerate(zip(stage_grads, keep_grads[index], strict=True)):
                if got.tobytes() != want.tobytes():
                    found.append(f"stage {index} grad {k} != keep-everything's")
        gathered = await transport.all_gather(
            rank, tuple(range(world)), f"grads {case.name} {label}", flat(grads, world, rank)
        )
        if rank == 0:
            for r, got in enumerate(gathered):
                if got.tobytes() != flat(local_grads, world, r).tobytes():
                    found.append(f"rank {r}'s gradients != the in-process run's")
            if all(set(s.chunk_policy.values()) == {"keep"} for s in local.ranks):
                found.append("the plan keeps every chunk: the budget does not bind")
        for message in found:
            say(f"rank {rank} case {case.name} {label} MISMATCH: {message}")
        if not found:
            policies = sorted(set(mine.chunk_policy.values()))
            say(
                f"rank {rank} case {case.name} {label} OK peak={mine.peak_saved_bytes} "
                f"budget={budget[rank]} policies={','.join(policies)}"
            )
        failed = failed or bool(found)
    return failed


async def main(transport: Any, names: list[str]) -> int:
    rank, world = transport.rank, transport.world_size
    failed = np.zeros(len(names), dtype=np.bool_)
    for index, name in enumerate(names):
        schedule, vpp, options = CASES[name]
        failed[index] = await check_case(transport, Case(name, schedule, vpp, options))
    everyone = await transport.all_gather(rank, tuple(range(world)), "failed", failed)
    return int(np.logical_or.reduce(everyone).sum())


if __name__ == "__main__":
    kind, chosen = sys.argv[1], sys.argv[2:]
    unknown = [name for name in chosen if name not in CASES]
    if kind not in ("torch", "mpi") or unknown or not chosen:
        raise SystemExit(f"usage: budget.py torch|mpi CASE [CASE ...], cases among {list(CASES)}")
    torch.set_num_threads(1)
    transport: Any
    if kind == "mpi":
        from ppswap.transports.mpi import MPITransport

        transport = MPITransport()
    else:
        transport = TorchDistTransport(timeout_s=120)
    with transport:
        try:
            failed = anyio.run(main, transport, chosen)
        except BaseException:
            print(f"rank {transport.rank} FAILED", file=sys.stderr, flush=True)
            traceback.print_exc()
            transport.abort(1)
    if failed:
        say(f"rank {transport.rank}: {failed} of {len(chosen)} cases failed")
        sys.exit(1)
