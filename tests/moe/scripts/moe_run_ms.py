"""One world rank of a MindSpore MoE run over MPITransport: pp2 x dp2 x ep2.

    mpiexec -n 4 python moe_run_ms.py OUT_DIR

As ``moe_run.py`` with MindSpore stages (``tests/moe/moe_support_ms.py``): 1F1B with
overlap_b_f, swap off then on; OUT_DIR/swap{0,1}-rank{w}.npz holds the loss and the
stage's gradients by position (``grad:{k}``). Then the same with the MoE blocks'
load-balancing loss (``AUX_LOSS_COEF``, swap on): OUT_DIR/aux-rank{w}.npz, with every
rank's reported term (``aux_loss``). A failure aborts the job (``MPI_Abort``).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import anyio
import mindspore as ms
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_support_ms import build_modules, make_data, mse_loss, split_stage

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.fsdp import DeviceMesh
from ppswap.transports.mpi import MPITransport

MESH = DeviceMesh(pp=2, dp=2, ep=2)
MICRO = 4
TOP_K = 2
AUX_LOSS_COEF = 0.5


async def run(
    stage: PipelineStage, data: tuple[Any, Any], swap: bool, transport: MPITransport
) -> RunResult:
    """The job's 1F1B step with overlap_b_f, this rank's ``stage`` of it."""
    x, y = data
    return await run_schedule(
        [stage],
        "1f1b",
        overlap_b_f=True,
        micro_batch_num=MICRO,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        swap=swap,
        min_swap_gap=2,
        transport=transport,
        step_timeout=120.0,
    )


def rank_stage(rank: int, aux_loss_coef: float = 0.0) -> PipelineStage:
    """World rank ``rank``'s stage: its pp stage of the MoE model, split for its dp replica."""
    coords = MESH.coords(rank)
    module = build_modules(MESH.pp, TOP_K, aux_loss_coef=aux_loss_coef)[coords.pp]
    return split_stage(module, coords.pp, MESH.pp, MESH, coords.dp)


async def main(transport: MPITransport, out_dir: Path) -> None:
    rank = transport.rank
    data = make_data(MESH.dp * MICRO * 2)
    stage = rank_stage(rank)
    for swap in (False, True):
        result = await run(stage, data, swap, transport)
        np.savez(
            out_dir / f"swap{int(swap)}-rank{rank}.npz",
            loss=np.array(result.loss),
            losses=np.array(result.losses),
            offloaded=np.array(sum(r.offloaded_bytes for r in result.ranks)),
            **{f"grad:{k}": g.asnumpy() for k, g in enumerate(stage.grads)},
        )
    stage = rank_stage(rank, AUX_LOSS_COEF)
    result = await run(stage, data, True, transport)
    np.savez(
        out_dir / f"aux-rank{rank}.npz",
        aux_loss=np.array([r.aux_loss for r in result.ranks]),
        **{f"grad:{k}": g.asnumpy() for k, g in enumerate(stage.grads)},
    )
    print(f"rank {rank} OK", flush=True)


if __name__ == "__main__":
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    with MPITransport() as mpi_transport:
        try:
            anyio.run(main, mpi_transport, Path(sys.argv[1]))
        except Exception:
            print(f"rank {mpi_transport.rank} failed:", file=sys.stderr)
            traceback.print_exc()
            mpi_transport.abort(1)
