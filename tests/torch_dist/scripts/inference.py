"""Run under ``torchrun --nproc_per_node N``: forward-only runs without ``loss_fn``.

GPipe (N stages) and Interleaved (2N), 2N micro-batches, over TorchDistTransport: the
process that runs the last stage gets its outputs (``RunResult.outputs``), one per
micro-batch and each equal to the unsplit model on that micro-batch (rtol 1e-6); every
other process gets none. Prints ``rank R SCHEDULE OK outputs=K`` per schedule, or
``MISMATCH`` lines and exits 1.
"""

from __future__ import annotations

import sys
from pathlib import Path

import anyio
import numpy as np
import torch
from torch import nn

from ppswap import PipelineStage, run_schedule
from ppswap.backends.torch.distributed import TorchDistTransport

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "torch_backend"))
from torch_support import build_modules, make_data


async def main(transport: TorchDistTransport) -> int:
    rank, world = transport.rank, transport.world_size
    failed = 0
    for schedule, vpp in (("gpipe", 1), ("interleaved_1f1b", 2)):
        stage_num, micro = world * vpp, 2 * world
        modules = build_modules(stage_num)
        stages = [
            PipelineStage(m, i, stage_num) for i, m in enumerate(modules) if i % world == rank
        ]
        x, _ = make_data(2 * micro)
        result = await run_schedule(
            stages,
            schedule,
            pp=world,
            micro_batch_num=micro,
            inputs=x,
            forward_only=True,
            transport=transport,
            step_timeout=60,
        )
        problems = []
        if any(s.is_last for s in stages):
            with torch.no_grad():
                model = nn.Sequential(*build_modules(stage_num))
                wanted = [model(part).numpy() for part in torch.from_numpy(x).chunk(micro)]
            if len(result.outputs) != micro:
                problems.append(f"{len(result.outputs)} outputs, want {micro}")
            for m, (got, want) in enumerate(zip(result.outputs, wanted, strict=False)):
                if not np.allclose(got, want, rtol=1e-6, atol=1e-7):
                    problems.append(f"micro-batch {m}'s output differs from the unsplit model's")
        elif result.outputs:
            problems.append(f"{len(result.outputs)} outputs where the last stage does not run")
        if result.losses:
            problems.append(f"losses {result.losses} in a run without loss_fn")
        for problem in problems:
            print(f"rank {rank} {schedule} MISMATCH: {problem}", flush=True)
        if not problems:
            print(f"rank {rank} {schedule} OK outputs={len(result.outputs)}", flush=True)
        failed += bool(problems)
    return failed


if __name__ == "__main__":
    with TorchDistTransport(timeout_s=120) as torch_transport:
        failures = anyio.run(main, torch_transport)
    sys.exit(1 if failures else 0)
