"""One rank of a MindSpore pipeline under memory_budget over MPITransport:
``mpiexec -n N python run_budget.py CASE [CASE ...]``.

A case is ``gpipe``, ``1f1b``, ``1f1b-overlap`` or ``interleaved`` (vpp 2): pp = N ranks,
2 * N micro-batches of the demo's MLP stages, every block wrapped by ``recompute_wrapper``
and ``swap_wrapper``. Every process builds all stages from one seed and runs three
calibration steps of the whole pipeline in this process (keep everything, the gap rule's
swap, recompute everything): ``CostModel.from_result`` of them, with fixed times (so every
process plans alike whatever its measured times), and the budgets: per rank half its
keep-everything peak (not below the planner's least) and recompute-everything's peak.
Then, per budget, the run over the transport (this rank's stages), which must keep this
rank's measured peak of saved bytes within its budget, choose the in-process plan's
policies, and give losses and gradients bit-identical to the keep-everything run and to
the same budget's run in this process (every rank's gradients, gathered on rank 0).

Prints ``rank R case NAME BUDGET OK peak=P budget=B policies=...`` per case and budget,
``rank R case NAME BUDGET MISMATCH: ...`` per failed check, and exits 1 on every rank when
any rank found a mismatch.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import replace
from typing import Any

import anyio
import mindspore as ms
import numpy as np
import numpy.typing as npt

from ppswap import PipelineStage, RunResult, recompute_wrapper, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.scheduler.budget import least_budgets
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel
from ppswap.swap import swap_wrapper
from ppswap.transports.mpi import MPITransport

Array = npt.NDArray[Any]
DIM, SAMPLES = 16, 2
CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "gpipe": ("gpipe", 1, {}),
    "1f1b": ("1f1b", 1, {}),
    "1f1b-overlap": ("1f1b", 1, {"overlap_b_f": True}),
    "interleaved": ("interleaved_1f1b", 2, {}),
}
"""Per case: the schedule, stages per rank and its other options."""


async def run(
    name: str, world: int, transport: MPITransport | None, **options: Any
) -> tuple[RunResult, dict[int, list[Array]]]:
    """The case over ``transport`` (this rank's stages) or in this process (None)."""
    schedule, vpp, case_options = CASES[name]
    stage_num, micro = world * vpp, 2 * world
    modules = build_mlp_stages(
        stage_num, dim=DIM, wrap=lambda b: recompute_wrapper(swap_wrapper(b))
    )
    stages = [
        PipelineStage(m, i, stage_num)
        for i, m in enumerate(modules)
        if transport is None or i % world == transport.rank
    ]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((SAMPLES * micro, DIM)).astype(np.float32)
    y = rng.standard_normal((SAMPLES * micro, DIM)).astype(np.float32)
    result = await run_schedule(
        stages,
        schedule,
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        pp=world,
        transport=transport,
        step_timeout=60.0,
        **case_options,
        **options,
    )
    grads = {s.stage_index: [g.asnumpy().copy() for g in s.grads] for s in stages}
    return result, grads


def peaks(result: RunResult) -> list[int]:
    return [rank.peak_saved_bytes for rank in result.ranks]


async def plan_inputs(name: str, world: int) -> tuple[CostModel, dict[str, list[int]]]:
    """The cost model and the budgets (module docstring), from runs in this process."""
    schedule, vpp, options = CASES[name]
    keep, _ = await run(name, world, None)
    swap, _ = await run(name, world, None, swap=True)
    recompute, _ = await run(name, world, None, recompute=True)
    model = replace(
        CostModel.from_result(keep, swap, recompute),
        leaf_s=1e-3,
        backward_leaf_s=2e-3,
        recompute_leaf_s=1e-3,
        swap_step_s=1e-4,
        d2h_gbps=1.0,
        h2d_gbps=1.0,
    )
    config = ScheduleConfig(
        schedule=schedule,  # type: ignore[arg-type]
        pp=world,
        vpp=vpp,
        micro=2 * world,
        swap=True,
        overlap_b_f=bool(options.get("overlap_b_f")),
    )
    least = least_budgets(config, model, frozenset(range(world * vpp)))
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


async def check_case(transport: MPITransport, name: str) -> bool:
    rank, world = transport.rank, transport.world_size
    model, budgets = await plan_inputs(name, world)
    keep, keep_grads = await run(name, world, None)
    failed = False
    for label, budget in budgets.items():
        options = dict(swap=True, memory_budget=dict(enumerate(budget)), cost_model=model)
        result, grads = await run(name, world, transport, **options)
        local, local_grads = await run(name, world, None, **options)
        mine = result.ranks[rank]
        found = []
        if mine.peak_saved_bytes > budget[rank]:
            found.append(f"peak {mine.peak_saved_bytes} over the budget {budget[rank]}")
        if mine.chunk_policy != local.ranks[rank].chunk_policy:
            found.append(f"policies {mine.chunk_policy} != in-process's")
        if np.array(result.losses).tobytes() != np.array(keep.losses).tobytes():
            found.append(f"losses {result.losses} != keep-everything {keep.losses}")
        for index, stage_grads in grads.items():
            for k, (got, want) in enumerate(zip(stage_grads, keep_grads[index], strict=True)):
                if got.tobytes() != want.tobytes():
                    found.append(f"stage {index} grad {k} != keep-everything's")
        gathered = await transport.all_gather(
            rank, tuple(range(world)), f"grads {name} {label}", flat(grads, world, rank)
        )
        if rank == 0:
            for r, got in enumerate(gathered):
                if got.tobytes() != flat(local_grads, world, r).tobytes():
                    found.append(f"rank {r}'s gradients != the in-process run's")
            if all(set(s.chunk_policy.values()) == {"keep"} for s in local.ranks):
                found.append("the plan keeps every chunk: the budget does not bind")
        for message in found:
            say(f"rank {rank} case {name} {label} MISMATCH: {message}")
        if not found:
            policies = ",".join(sorted(set(mine.chunk_policy.values())))
            say(
                f"rank {rank} case {name} {label} OK peak={mine.peak_saved_bytes} "
                f"budget={budget[rank]} policies={policies}"
            )
        failed = failed or bool(found)
    return failed


async def main(transport: MPITransport, names: list[str]) -> int:
    rank, world = transport.rank, transport.world_size
    failed = np.zeros(len(names), dtype=np.bool_)
    for index, name in enumerate(names):
        failed[index] = await check_case(transport, name)
    everyone = await transport.all_gather(rank, tuple(range(world)), "failed", failed)
    return int(np.logical_or.reduce(everyone).sum())


if __name__ == "__main__":
    chosen = sys.argv[1:]
    unknown = [name for name in chosen if name not in CASES]
    if unknown or not chosen:
        raise SystemExit(f"cases must be among {', '.join(CASES)}, got {chosen}")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    mpi_transport = MPITransport()
    with mpi_transport:
        try:
            failed = anyio.run(main, mpi_transport, chosen)
        except BaseException:
            print(f"rank {mpi_transport.rank} FAILED", file=sys.stderr, flush=True)
            traceback.print_exc()
            mpi_transport.abort(1)
    if failed:
        say(f"rank {mpi_transport.rank}: {failed} of {len(chosen)} cases failed")
        sys.exit(1)
