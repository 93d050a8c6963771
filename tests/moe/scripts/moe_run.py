"""One world rank of a MoE run across processes: pp2 x dp2 x ep2 (torch stages).

    mpiexec -n 4 python moe_run.py OUT_DIR mpi
    torchrun --standalone --nproc_per_node 4 moe_run.py OUT_DIR torch

World rank ``w`` is pipeline rank ``w % 2`` of dp replica ``w // 2`` (EP rank ``w //
2``): it builds every stage module from the same seed, keeps its pipeline rank's, splits
its experts (``expert_parallel``), shards its dense parameters (``fully_shard``) and
runs 1F1B with overlap_b_f, swap off, swap on, then recomputing every chunk (the blocks
are wrapped by ``recompute_wrapper`` and ``swap_wrapper``: a recomputed MoE forward
makes its all-to-alls again). It writes OUT_DIR/swap{0,1}-rank{w}.npz and
OUT_DIR/recompute-rank{w}.npz: the loss and its stage's gradients by parameter name. A
failure aborts the job.
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moe_support import build_modules, local_grads, make_data, mse_loss, recompute_and_swap

from ppswap import PipelineStage, expert_parallel, fully_shard, run_schedule
from ppswap.fsdp import DeviceMesh

MESH = DeviceMesh(pp=2, dp=2, ep=2)
MICRO = 4
TOP_K = 2


async def main(transport: Any, out_dir: Path) -> None:
    rank = transport.rank
    coords = MESH.coords(rank)
    x, y = make_data(MESH.dp * MICRO * 2)
    module = build_modules(MESH.pp, TOP_K, wrap=recompute_and_swap)[coords.pp]
    expert_parallel(module, mesh=MESH, dp_rank=coords.dp)
    fully_shard(module, mesh=MESH, dp_rank=coords.dp)
    stage = PipelineStage(module, coords.pp, MESH.pp)
    for name, swap, recompute in (
        ("swap0", False, False),
        ("swap1", True, False),
        ("recompute", False, True),
    ):
        result = await run_schedule(
            [stage],
            "1f1b",
            overlap_b_f=True,
            micro_batch_num=MICRO,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            swap=swap,
            recompute=recompute,
            min_swap_gap=2,
            transport=transport,
            step_timeout=60.0,
        )
        grads = {f"grad:{name}": grad for name, grad in local_grads(stage).items()}
        np.savez(
            out_dir / f"{name}-rank{rank}.npz",
            loss=np.array(result.loss),
            losses=np.array(result.losses),
            offloaded=np.array(sum(r.offloaded_bytes for r in result.ranks)),
            **grads,
        )
    print(f"rank {rank} OK", flush=True)


def _run(transport: Any) -> None:
    try:
        anyio.run(main, transport, Path(sys.argv[1]))
    except Exception:
        print(f"rank {transport.rank} failed:", file=sys.stderr)
        traceback.print_exc()
        transport.abort(1)


if __name__ == "__main__":
    if sys.argv[2] == "mpi":
        from ppswap.transports.mpi import MPITransport

        with MPITransport() as mpi_transport:
            _run(mpi_transport)
    else:
        from ppswap.backends.torch.distributed import TorchDistTransport

        with TorchDistTransport(timeout_s=120) as torch_transport:
            _run(torch_transport)
