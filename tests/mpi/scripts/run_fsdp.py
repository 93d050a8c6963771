"""One world rank of an FSDP dp2 x pp(N/2) run over MPITransport (MindSpore stages).

    mpiexec -n N python run_fsdp.py OUT_DIR        (N = 2: pp1 x dp2, N = 4: pp2 x dp2)

World rank ``w`` is pipeline rank ``w % pp`` of dp replica ``w // pp``: it builds every
stage module from the same seed (as the in-process reference does), keeps its pipeline
rank's stage, ``fully_shard``s it with its dp rank and runs it. For GPipe and 1F1B, swap
off and then on (the same stages run again), it writes OUT_DIR/{case}-rank{w}.npz: the
losses it got back, the world ranks and offloaded bytes of the stats, its stage's shard
gradients (``shard_*``) and the full gradients gathered across the dp group (``full_*``,
``gather_full_gradients``). A failure aborts the job (``MPI_Abort``).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "fsdp"))
from fsdp_support import DIM, batch

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.fsdp import DeviceMesh, fully_shard, gather_full_gradients
from ppswap.swap import swap_wrapper
from ppswap.transports.mpi import MPITransport

DP = 2
MICRO = 4
BATCH = 16  # dp 2 x micro 4 x 2 samples
SCHEDULES = ("gpipe", "1f1b")
MIN_SWAP_GAP = 2  # the default 4 swaps nothing on 1F1B pp2; 2 swaps rank 0's chunks


def case_name(schedule: str, swap: bool) -> str:
    return f"{schedule}-swap{int(swap)}"


async def main(transport: MPITransport, out_dir: Path) -> None:
    rank, world = transport.rank, transport.world_size
    mesh = DeviceMesh(pp=world // DP, dp=DP)
    coords = mesh.coords(rank)
    x, y = batch(BATCH)
    for schedule in SCHEDULES:
        module = build_mlp_stages(mesh.pp, dim=DIM, wrap=swap_wrapper)[coords.pp]
        fully_shard(module, mesh=mesh, dp_rank=coords.dp)
        stage = PipelineStage(module, coords.pp, mesh.pp)
        for swap in (False, True):
            result = await run_schedule(
                [stage],
                schedule,
                micro_batch_num=MICRO,
                inputs=x,
                targets=y,
                loss_fn=mse_loss,
                swap=swap,
                min_swap_gap=MIN_SWAP_GAP,
                transport=transport,
                step_timeout=60.0,
            )
            full = await gather_full_gradients(stage, transport)
            arrays = {f"shard_{k}": g.asnumpy() for k, g in enumerate(stage.grads)}
            arrays.update({f"full_{k}": g for k, g in enumerate(full)})
            np.savez(
                out_dir / f"{case_name(schedule, swap)}-rank{rank}.npz",
                losses=np.array(result.losses),
                loss=np.array(result.loss),
                stat_ranks=np.array([r.rank for r in result.ranks]),
                offloaded=np.array([r.offloaded_bytes for r in result.ranks]),
                **arrays,
            )
    print(f"rank {rank} OK: {2 * len(SCHEDULES)} runs", flush=True)


if __name__ == "__main__":
    mpi_transport = MPITransport()
    try:
        anyio.run(main, mpi_transport, Path(sys.argv[1]))
    except Exception:
        print(f"rank {mpi_transport.rank} failed:", file=sys.stderr)
        traceback.print_exc()
        mpi_transport.abort(1)
    mpi_transport.close()
