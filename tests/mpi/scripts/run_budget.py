"""One rank of a MindSpore pipeline under memory_budget over MPITransport:
``mpiexec -n N python run_budget.py CASE [CASE ...]``.

The stages are the demo's MLP stages, every block wrapped by ``recompute_wrapper`` and
``swap_wrapper``; the cases, the calibration, the budgets and the checks are
``tests/budget_checks.py``'s.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import mindspore as ms
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: budget_checks
from budget_checks import Case, Grads, check_cases, chosen_cases

from ppswap import PipelineStage, RunResult, recompute_wrapper, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.swap import swap_wrapper
from ppswap.transports.mpi import MPITransport

DIM, SAMPLES = 16, 2


async def run(
    case: Case, world: int, transport: MPITransport | None, **options: Any
) -> tuple[RunResult, Grads]:
    """``case`` over ``transport`` (this rank's stages) or in this process (None)."""
    stage_num, micro = case.stage_num(world), case.micro(world)
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
        case.schedule,
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        pp=world,
        transport=transport,
        step_timeout=60.0,
        **case.options,
        **options,
    )
    grads = {s.stage_index: [g.asnumpy().copy() for g in s.grads] for s in stages}
    return result, grads


if __name__ == "__main__":
    cases = chosen_cases(sys.argv[1:], "run_budget.py CASE [CASE ...]")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    check_cases(run, MPITransport(), cases)
