"""Tensor-level swap on MindSpore: register one tensor inside a block's construct.

    python examples/tensor_swap.py

Needs MindSpore (``pip install -e '.[mindspore]'``); without it, it exits with one line
saying so.
"""

from __future__ import annotations

import sys

import numpy as np

from ppswap import PipelineStage, ScheduleGPipe
from ppswap.swap import swap_tensor_wrapper

try:
    from mindspore import Tensor, nn, ops

    from ppswap.demo.model import mse_loss
except ModuleNotFoundError as missing:
    if missing.name != "mindspore":
        raise
    sys.exit(
        "examples/tensor_swap.py runs on MindSpore, which is not installed: "
        "pip install -e '.[mindspore]' in the ppswap checkout "
        "(examples/torch_pipeline.py is a torch example)"
    )


class Block(nn.Cell):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.attn = nn.Dense(dim, dim)
        self.norm1 = nn.LayerNorm((dim,))

    def construct(self, x: Tensor) -> Tensor:
        attn_out = ops.tanh(self.attn(x))
        # Only this tensor is swapped: it is what the norm saves for its backward.
        attn_out = swap_tensor_wrapper(attn_out, tag="attn_out", group_swap=True)
        return self.norm1(x + attn_out)


def main() -> None:
    pp, micro, dim = 4, 8, 32
    stages = [PipelineStage(nn.SequentialCell([Block(dim), Block(dim)]), i, pp) for i in range(pp)]
    schedule = ScheduleGPipe(stages, micro_batch_num=micro, loss_fn=mse_loss, swap=True)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, dim)).astype(np.float32)
    y = rng.standard_normal((16, dim)).astype(np.float32)
    result = schedule.run(x, targets=y)
    print(f"loss {result.loss:.6f}")
    for rank in result.ranks:
        print(f"rank {rank.rank}: offloaded {rank.offloaded_bytes} B")
    print(f"gradient norm of stage 0: {float(ops.norm(stages[0].grads[0]).asnumpy()):.6f}")


if __name__ == "__main__":
    main()
