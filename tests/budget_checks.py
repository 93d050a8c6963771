"""The checks of a pipeline under ``memory_budget`` across processes, for any framework.

A launch script (``tests/torch_dist/scripts/budget.py``, ``tests/mpi/scripts/run_budget.py``)
gives a ``Runner``: it builds every stage from one seed, keeps this rank's (all of them
when ``transport`` is None) and runs the case, returning the result and the stages'
gradients as NumPy arrays. Everything else is here and framework-free.

A case is ``gpipe``, ``1f1b``, ``1f1b-overlap`` or ``interleaved`` (vpp 2): pp = N ranks,
2 * N micro-batches. Every process runs three calibration steps of the whole pipeline in
this process (keep everything, the gap rule's swap, recompute everything):
``CostModel.from_result`` of them, with fixed times (so every process plans alike whatever
its measured times), and the budgets: per rank half its keep-everything peak (not below
the planner's least) and recompute-everything's peak. Then, per budget, the run over the
transport (this rank's stages). Per case, budget and rank it checks:

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
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import anyio
import numpy as np
import numpy.typing as npt

from ppswap import RunResult
from ppswap.scheduler.budget import least_budgets
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_model import CostModel

Array = npt.NDArray[Any]
Grads = dict[int, list[Array]]
"""Per stage index, its gradients as NumPy arrays."""


@dataclass(frozen=True)
class Case:
    name: str
    schedule: str
    vpp: int
    options: dict[str, Any] = field(default_factory=dict)

    def stage_num(self, world: int) -> int:
        return world * self.vpp

    def micro(self, world: int) -> int:
        return 2 * world


CASES = {
    case.name: case
    for case in (
        Case("gpipe", "gpipe", 1),
        Case("1f1b", "1f1b", 1),
        Case("1f1b-overlap", "1f1b", 1, {"overlap_b_f": True}),
        Case("interleaved", "interleaved_1f1b", 2),
    )
}


class Runner(Protocol):
    def __call__(
        self, case: Case, world: int, transport: Any, **options: Any
    ) -> Awaitable[tuple[RunResult, Grads]]:
        """``case`` over ``transport`` (this rank's stages) or in this process (None)."""
        ...


def chosen_cases(names: list[str], usage: str) -> list[Case]:
    """The cases ``names`` asks for; exits with ``usage`` on an unknown or empty list."""
    unknown = [name for name in names if name not in CASES]
    if unknown or not names:
        raise SystemExit(f"usage: {usage}, cases among {list(CASES)}; got {names}")
    return [CASES[name] for name in names]


def say(line: str) -> None:
    sys.stdout.write(f"{line}\n")
    sys.stdout.flush()


def _peaks(result: RunResult) -> list[int]:
    return [rank.peak_saved_bytes for rank in result.ranks]


def _flat(grads: Grads, world: int, rank: int) -> Array:
    parts = [
        g.reshape(-1).view(np.uint8) for i in sorted(grads) if i % world == rank for g in grads[i]
    ]
    return np.concatenate(parts)


async def _plan_inputs(
    run: Runner, case: Case, world: int
) -> tuple[CostModel, dict[str, list[int]]]:
    """The cost model and the budgets (module docstring), from runs in this process."""
    keep, _ = await run(case, world, None)
    swap, _ = await run(case, world, None, swap=True)
    recompute, _ = await run(case, world, None, recompute=True)
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
        schedule=case.schedule,  # type: ignore[arg-type]
        pp=world,
        vpp=case.vpp,
        micro=case.micro(world),
        swap=True,
        overlap_b_f=bool(case.options.get("overlap_b_f")),
    )
    least = least_budgets(config, model, frozenset(range(case.stage_num(world))))
    budgets = {
        "50%": [max(p // 2, q) for p, q in zip(_peaks(keep), least, strict=True)],
        "recompute-all": [max(p, q) for p, q in zip(_peaks(recompute), least, strict=True)],
    }
    return model, budgets


async def _check_case(run: Runner, transport: Any, case: Case) -> bool:
    """Whether any check of ``case`` failed on this rank (each failure printed)."""
    rank, world = transport.rank, transport.world_size
    model, budgets = await _plan_inputs(run, case, world)
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
            rank, tuple(range(world)), f"grads {case.name} {label}", _flat(grads, world, rank)
        )
        if rank == 0:
            for r, got in enumerate(gathered):
                if got.tobytes() != _flat(local_grads, world, r).tobytes():
                    found.append(f"rank {r}'s gradients != the in-process run's")
            if all(set(s.chunk_policy.values()) == {"keep"} for s in local.ranks):
                found.append("the plan keeps every chunk: the budget does not bind")
        for message in found:
            say(f"rank {rank} case {case.name} {label} MISMATCH: {message}")
        if not found:
            policies = ",".join(sorted(set(mine.chunk_policy.values())))
            say(
                f"rank {rank} case {case.name} {label} OK peak={mine.peak_saved_bytes} "
                f"budget={budget[rank]} policies={policies}"
            )
        failed = failed or bool(found)
    return failed


async def _failed_cases(run: Runner, transport: Any, cases: list[Case]) -> int:
    """How many cases failed on some rank (every rank gets the same count)."""
    rank, world = transport.rank, transport.world_size
    failed = np.zeros(len(cases), dtype=np.bool_)
    for index, case in enumerate(cases):
        failed[index] = await _check_case(run, transport, case)
    everyone = await transport.all_gather(rank, tuple(range(world)), "failed", failed)
    return int(np.logical_or.reduce(everyone).sum())


def check_cases(run: Runner, transport: Any, cases: list[Case]) -> None:
    """This rank's part of the checks over ``transport`` (a context manager that joins the
    group); aborts the group on an error, exits 1 when any case failed on any rank."""
    with transport:
        try:
            failed = anyio.run(_failed_cases, run, transport, cases)
        except BaseException:
            print(f"rank {transport.rank} FAILED", file=sys.stderr, flush=True)
            traceback.print_exc()
            transport.abort(1)
    if failed:
        say(f"rank {transport.rank}: {failed} of {len(cases)} cases failed")
        sys.exit(1)
