"""The batches and models both the MPI ranks and the in-process reference train on (no MPI
import): the float32 batch of the MLP stages, and a bfloat16 model with its batch; how
both read a gradient (``host``)."""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn

from ppswap.swap import swap_wrapper

DIM, BATCH = 8, 8


def host(grad: Any) -> np.ndarray:
    """A gradient of either framework as a numpy array."""
    if hasattr(grad, "asnumpy"):
        return np.asarray(grad.asnumpy())
    return np.asarray(grad.detach().numpy())


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return (
        rng.standard_normal((BATCH, DIM)).astype(np.float32),
        rng.standard_normal((BATCH, DIM)).astype(np.float32),
    )


# -- a bfloat16 model: elementwise only (MindSpore's CPU kernels reduce no bfloat16) ------


class _Scale(nn.Cell):
    """``x * w * x + x``, ``w`` bfloat16 of a micro-batch's shape (so no gradient needs a
    bfloat16 reduction), from ``seed``."""

    def __init__(self, seed: int, rows: int) -> None:
        super().__init__()
        values = np.random.default_rng(seed).standard_normal((rows, DIM)).astype(np.float32)
        self.w = Parameter(Tensor(values).astype(ms.bfloat16), name=f"w{seed}")

    def construct(self, x: Any) -> Any:
        return x * self.w * x + x


def bf16_stages(stage_num: int, rows: int) -> list[nn.Cell]:
    """``stage_num`` stages of two swap-wrapped ``_Scale`` blocks for micro-batches of
    ``rows`` rows, a seed per block."""
    return [
        nn.SequentialCell(
            [swap_wrapper(_Scale(2 * i, rows)), swap_wrapper(_Scale(2 * i + 1, rows))]
        )
        for i in range(stage_num)
    ]


def bf16_data() -> tuple[np.ndarray, np.ndarray]:
    """``data()`` rounded to MindSpore's numpy bfloat16."""
    x, y = data()
    return Tensor(x).astype(ms.bfloat16).asnumpy(), Tensor(y).astype(ms.bfloat16).asnumpy()


def bf16_loss(output: Any, target: Any) -> Any:
    """Mean squared error in float32 (no bfloat16 reduction)."""
    diff = output.astype(ms.float32) - target.astype(ms.float32)
    return (diff * diff).mean()
