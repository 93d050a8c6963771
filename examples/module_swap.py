"""Module-level swap on MindSpore: wrap the layers, then let the schedule move them.

    python examples/module_swap.py

Needs MindSpore (``pip install -e '.[mindspore]'``); without it, it exits with one line
saying so. ``examples/torch_pipeline.py`` is a torch example.
"""

from __future__ import annotations

import sys

import numpy as np

from ppswap import PipelineStage, ScheduleInterleaved1F1B
from ppswap.swap import swap_wrapper

try:
    from ppswap.demo.model import build_mlp_stages, mse_loss
except ModuleNotFoundError as missing:
    if missing.name != "mindspore":
        raise
    sys.exit(
        "examples/module_swap.py runs on MindSpore, which is not installed: "
        "pip install -e '.[mindspore]' in the ppswap checkout "
        "(examples/torch_pipeline.py is a torch example)"
    )


def main() -> None:
    pp, vpp, micro = 2, 2, 8
    modules = build_mlp_stages(pp * vpp, dim=32, blocks_per_stage=2)
    for module in modules:
        # Select the layers to swap; assigning the wrapper back is what enables it.
        for index, layer in enumerate(module):
            module[index] = swap_wrapper(layer, group_swap=True)
    stages = [PipelineStage(m, i, stage_num=pp * vpp) for i, m in enumerate(modules)]
    schedule = ScheduleInterleaved1F1B(
        stages, micro_batch_num=micro, loss_fn=mse_loss, pp=pp, swap=True
    )
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 32)).astype(np.float32)
    y = rng.standard_normal((32, 32)).astype(np.float32)
    result = schedule.run(x, targets=y)
    print(f"loss {result.loss:.6f}")
    for rank in result.ranks:
        print(
            f"rank {rank.rank}: peak saved {rank.peak_saved_bytes} B, "
            f"offloaded {rank.offloaded_bytes} B"
        )


if __name__ == "__main__":
    main()
