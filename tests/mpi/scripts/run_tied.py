"""One rank of a tied GPT-2 style MindSpore model over MPITransport:
``mpiexec -n 2 python run_tied.py``.

Stage 0 projects by ``wte`` and the last stage's head multiplies by a copy of it, both
declared ``tied`` under one key (``tests/tied_cells.py``), on different ranks.
For each case of ``CASES`` (1F1B, Interleaved, 1F1B with the dx/dw split, Interleaved
with overlap_b_f), swap off and on, each rank checks its loss and its stages' gradients
against the unsplit model (rtol 1e-5) and prints ``rank R CASE-swap-on|off tied SHA``
where it holds a copy (``tied_cells.digest``). Prints ``rank R OK`` at the end; a
mismatch raises, and the rank aborts the job.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/: tied_cells
from tied_cells import cells, data, declared, digest, tied_index, unsplit

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import mse_loss
from ppswap.transports.mpi import MPITransport

CASES: dict[str, tuple[str, int, dict[str, Any]]] = {
    "1f1b": ("1f1b", 1, {}),
    "interleaved_1f1b": ("interleaved_1f1b", 2, {}),
    "1f1b_split_dw": ("1f1b", 1, {"split_dw": True}),
    "interleaved_1f1b_overlap": ("interleaved_1f1b", 2, {"overlap_b_f": True}),
}
"""Per case: the schedule, stages per rank and its other options."""
MICRO = 4


def check(condition: bool, what: str) -> None:
    if not condition:
        raise AssertionError(what)


async def one_case(transport: MPITransport, name: str, swap: bool) -> None:
    schedule, vpp, options = CASES[name]
    rank, world = transport.rank, transport.world_size
    stage_num = world * vpp
    modules = cells(stage_num, shared=False)
    mine = [
        PipelineStage(modules[s], s, stage_num, tied=declared(s, stage_num))
        for s in range(rank, stage_num, world)
    ]
    x, y = data()
    result = await run_schedule(
        mine,
        schedule,
        micro_batch_num=MICRO,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=swap,
        transport=transport,
        step_timeout=60.0,
        **options,
    )
    want_loss, want = unsplit(stage_num)
    check(abs(result.loss - want_loss) <= 1e-5 * abs(want_loss), f"loss {result.loss}")
    case = f"{name}-swap-{'on' if swap else 'off'}"
    for stage in mine:
        for grad, expected in zip(stage.grads, want[stage.stage_index], strict=True):
            close = np.allclose(grad.asnumpy(), expected, rtol=1e-5, atol=1e-6)
            check(close, f"{case}: a gradient of stage {stage.stage_index}")
        if stage.tied:
            tied = stage.grads[tied_index(stage.module, stage.parameters)]
            print(f"rank {rank} {case} tied {digest(tied)}", flush=True)


async def main(transport: MPITransport) -> None:
    for name in CASES:
        for swap in (False, True):
            await one_case(transport, name, swap)
    print(f"rank {transport.rank} OK", flush=True)


if __name__ == "__main__":
    transport = MPITransport()
    with transport:
        try:
            anyio.run(main, transport)
        except BaseException:
            print(f"rank {transport.rank} FAILED", file=sys.stderr, flush=True)
            traceback.print_exc()
            transport.abort(1)
