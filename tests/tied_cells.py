"""A GPT-2 style MindSpore model whose head multiplies by the input projection's weight,
cut into pipeline stages (tests of tied parameters, in one process and over MPI).

The first stage projects its input by ``wte`` (an embedding of a one-hot input), the
last multiplies its hidden state by ``wte``'s transpose (the head): with ``shared=True``
the very Parameter object of the first stage, else a copy of its own, which the stages
then declare tied (``TIED``).
"""

from __future__ import annotations

import hashlib

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from ppswap.demo.model import mse_loss
from ppswap.swap import swap_wrapper

VOCAB, DIM, BATCH = 11, 8, 8
TIED = {"first": {"wte": "embedding"}, "last": {"head": "embedding"}}


class Block(nn.Cell):  # type: ignore[misc]
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Dense(DIM, 2 * DIM), nn.Dense(2 * DIM, DIM)

    def construct(self, x: Tensor) -> Tensor:
        return x + self.fc2(ops.tanh(self.fc1(x)))


class First(nn.Cell):  # type: ignore[misc]
    def __init__(self, weight: Parameter) -> None:
        super().__init__()
        self.wte, self.block = weight, swap_wrapper(Block())

    def construct(self, x: Tensor) -> Tensor:
        return self.block(ops.matmul(x, self.wte))


class Last(nn.Cell):  # type: ignore[misc]
    def __init__(self, weight: Parameter) -> None:
        super().__init__()
        self.block, self.head = swap_wrapper(Block()), weight

    def construct(self, x: Tensor) -> Tensor:
        return ops.matmul(self.block(x), self.head.T)


def cells(stage_num: int, *, shared: bool) -> list[nn.Cell]:
    ms.set_seed(0)
    table = np.random.default_rng(0).standard_normal((VOCAB, DIM)).astype(np.float32)
    wte = Parameter(Tensor(table), name="wte")
    head = wte if shared else Parameter(Tensor(table.copy()), name="head")
    return [First(wte), *(swap_wrapper(Block()) for _ in range(stage_num - 2)), Last(head)]


def declared(stage_index: int, stage_num: int) -> dict[str, str] | None:
    """The ``tied`` declaration of a stage of ``cells(stage_num, shared=False)``."""
    if stage_index == 0:
        return TIED["first"]
    return TIED["last"] if stage_index == stage_num - 1 else None


def tied_index(stage_cell: nn.Cell, parameters: tuple[Parameter, ...]) -> int:
    """The index of the stage's tied weight (``wte`` or ``head``) in its parameters."""
    weight = stage_cell.wte if isinstance(stage_cell, First) else stage_cell.head
    return next(i for i, p in enumerate(parameters) if p is weight)


def data(batch: int = BATCH) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = np.eye(VOCAB, dtype=np.float32)[rng.integers(0, VOCAB, batch)]
    return x, rng.standard_normal((batch, VOCAB)).astype(np.float32)


def unsplit(stage_num: int, batch: int = BATCH) -> tuple[float, list[list[np.ndarray]]]:
    """The unsplit model's loss and per stage its parameters' gradients."""
    modules = cells(stage_num, shared=True)
    model = nn.SequentialCell(modules)
    x, y = data(batch)
    weights = model.trainable_params()

    def loss() -> Tensor:
        return mse_loss(model(Tensor(x)), Tensor(y))

    value, vjp_fn = ms.vjp(loss, weights=weights)
    _, grads = vjp_fn(Tensor(np.float32(1.0)))
    by_object = {id(w): g.asnumpy() for w, g in zip(weights, grads, strict=True)}
    per_stage = [[by_object[id(p)] for p in m.trainable_params()] for m in modules]
    return float(value.asnumpy()), per_stage


def digest(grad: Tensor) -> str:
    """The first 16 hex digits of the SHA-256 of a gradient's bytes."""
    return hashlib.sha256(grad.asnumpy().tobytes()).hexdigest()[:16]
