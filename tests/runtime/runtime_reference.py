"""The reference for every runtime test: the unsplit model on the whole batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import mindspore as ms
import numpy as np
from mindspore import Tensor, nn

from ppswap.demo.model import build_lm_unsplit


def unsplit_loss_and_grads(
    modules: Sequence[nn.Cell],
    inputs: np.ndarray,
    targets: np.ndarray,
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    micro: int,
) -> tuple[float, list[list[np.ndarray]]]:
    """Mean over micro-batches of the per-micro loss, and its gradients per stage.

    With equal micro-batches and a mean-reduced loss this equals the full-batch loss.
    Gradients come back grouped per stage, aligned with each stage's trainable_params().
    """
    model = build_lm_unsplit(list(modules))
    params = model.trainable_params()
    x = Tensor(inputs)
    y = Tensor(targets)

    def full_loss() -> Tensor:
        return loss_fn(model(x), y)

    loss, vjp_fn = ms.vjp(full_loss, weights=params)
    _, grads = vjp_fn(Tensor(np.float32(1.0)))
    flat = [g.asnumpy() for g in grads]
    per_stage: list[list[np.ndarray]] = []
    cursor = 0
    for module in modules:
        count = len(module.trainable_params())
        per_stage.append(flat[cursor : cursor + count])
        cursor += count
    del micro
    return float(loss.asnumpy()), per_stage
