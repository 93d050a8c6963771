"""One rank of a pipeline run over MPITransport; writes what it computed for the test.

    mpiexec -n N python run_pipeline.py OUT_DIR SCHEDULE STAGE_NUM MICRO OVERLAP SWAP [FAIL [MODEL]]

Every process builds all stage modules from the same seed (as the in-process reference
does) and runs only its own stages. Rank r writes OUT_DIR/rank{r}.npz with the losses it
got back and the gradients of its stages. FAIL=1 makes rank 1's FWD of micro 1 raise.
MODEL=bfloat16 runs ``pipeline_data``'s bfloat16 model instead of the float32 MLP;
MODEL=tuple ``ppswap.demo.model``'s ``TupleStage``s, which pass three tensors between stages;
MODEL=torch the torch stage models of ``tests/torch_backend/torch_support.py`` (attention
and MLP blocks, swap-wrapped) on their float32 batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import numpy as np

from ppswap import PipelineStage, run_schedule
from ppswap.core.faults import FaultPlan, fail_compute
from ppswap.demo.model import build_mlp_stages, build_tuple_stages, mse_loss
from ppswap.scheduler.steps import StepKind
from ppswap.swap import swap_wrapper
from ppswap.transports.mpi import MPITransport

sys.path.insert(0, str(Path(__file__).parent))
from pipeline_data import BATCH, DIM, bf16_data, bf16_loss, bf16_stages, data, host


async def main() -> None:
    out_dir = Path(sys.argv[1])
    schedule, stage_num, micro = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    overlap, swap = sys.argv[5] == "1", sys.argv[6] == "1"
    fail = len(sys.argv) > 7 and sys.argv[7] == "1"
    model = sys.argv[8] if len(sys.argv) > 8 else "mlp"
    bf16 = model == "bfloat16"
    transport = MPITransport()
    rank, world = transport.rank, transport.world_size
    if bf16:
        modules, (x, y), loss_fn = bf16_stages(stage_num, BATCH // micro), bf16_data(), bf16_loss
    elif model == "tuple":
        modules = build_tuple_stages(stage_num, dim=DIM, wrap=swap_wrapper)
        (x, y), loss_fn = data(), mse_loss
    elif model == "torch":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch_backend"))
        import torch
        import torch_support

        torch.set_num_threads(1)
        modules = torch_support.build_modules(stage_num)
        (x, y), loss_fn = torch_support.make_data(), torch_support.mse_loss
    else:
        modules = build_mlp_stages(stage_num, dim=DIM, wrap=swap_wrapper)
        (x, y), loss_fn = data(), mse_loss
    stages = [PipelineStage(m, i, stage_num) for i, m in enumerate(modules) if i % world == rank]
    faults = FaultPlan(rules=(fail_compute(StepKind.FWD, rank=1, micro=1),)) if fail else None
    result = await run_schedule(
        stages,
        schedule,
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=loss_fn,
        swap=swap,
        overlap_b_f=overlap,
        transport=transport,
        step_timeout=60,
        faults=faults,
    )
    grads = {  # bfloat16 as its bits (np.savez cannot store the extension dtype)
        f"grad_s{s.stage_index}_{k}": host(g).view(np.uint16) if bf16 else host(g)
        for s in stages
        for k, g in enumerate(s.grads)
    }
    np.savez(
        out_dir / f"rank{rank}.npz",
        losses=np.array(result.losses),
        offloaded=np.array([r.offloaded_bytes for r in result.ranks]),
        stat_ranks=np.array([r.rank for r in result.ranks]),
        **grads,
    )
    transport.close()


if __name__ == "__main__":
    anyio.run(main)
