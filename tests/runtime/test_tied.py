"""Tied parameters on MindSpore, in one process (``ppswap/actors/ties.py``; the torch twin
with more schedules, FSDP and the refusals: ``tests/torch_backend/test_torch_tied.py``).

A GPT-2 style model: the first stage projects its input by ``wte`` (an embedding of a
one-hot input), the last multiplies its hidden state by ``wte``'s transpose (the head).
Held as one Parameter object by both stages (found by identity) or as two declared
copies: the loss and every gradient equal the unsplit model's (rtol 1e-5), both holders'
``stage.grads`` entries are the whole gradient, bit for bit the same, and swap on is
bit-identical to swap off.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
import pytest
from mindspore import Parameter, Tensor, nn, ops

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import mse_loss
from ppswap.swap import swap_wrapper

VOCAB, DIM, BATCH = 11, 8, 8
CASES = {"gpipe-pp2": ("gpipe", 2, 2), "interleaved-pp2-vpp2": ("interleaved_1f1b", 2, 4)}


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


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = np.eye(VOCAB, dtype=np.float32)[rng.integers(0, VOCAB, BATCH)]
    return x, rng.standard_normal((BATCH, VOCAB)).astype(np.float32)


def unsplit(stage_num: int) -> tuple[float, list[list[np.ndarray]]]:
    """The unsplit model's loss and per stage its parameters' gradients."""
    modules = cells(stage_num, shared=True)
    model = nn.SequentialCell(modules)
    x, y = data()
    weights = model.trainable_params()

    def loss() -> Tensor:
        return mse_loss(model(Tensor(x)), Tensor(y))

    value, vjp_fn = ms.vjp(loss, weights=weights)
    _, grads = vjp_fn(Tensor(np.float32(1.0)))
    by_object = {id(w): g.asnumpy() for w, g in zip(weights, grads, strict=True)}
    per_stage = [[by_object[id(p)] for p in m.trainable_params()] for m in modules]
    return float(value.asnumpy()), per_stage


@pytest.mark.timeout(240)
@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("how", ["shared", "declared"])
async def test_a_tied_model_equals_the_unsplit_one(case: str, how: str) -> None:
    schedule, pp, stage_num = CASES[case]
    want_loss, want = unsplit(stage_num)
    tied = {0: {"wte": "embedding"}, stage_num - 1: {"head": "embedding"}}
    runs = []
    for swap in (False, True):
        modules = cells(stage_num, shared=how == "shared")
        stages = [
            PipelineStage(m, i, stage_num, tied=tied.get(i) if how == "declared" else None)
            for i, m in enumerate(modules)
        ]
        x, y = data()
        options: dict[str, Any] = {"pp": pp, "micro_batch_num": 4, "step_timeout": 120}
        result = await run_schedule(
            stages, schedule, inputs=x, targets=y, loss_fn=mse_loss, swap=swap, **options
        )
        assert result.loss == pytest.approx(want_loss, rel=1e-5)
        first, last = stages[0], stages[-1]
        k_first = next(i for i, p in enumerate(first.parameters) if p is first.module.wte)
        k_last = next(i for i, p in enumerate(last.parameters) if p is last.module.head)
        assert np.array_equal(first.grads[k_first].asnumpy(), last.grads[k_last].asnumpy())
        # the unsplit model's gradients (its head is the embedding's object)
        for stage, reference in zip(stages, want, strict=True):
            for grad, expected in zip(stage.grads, reference, strict=True):
                np.testing.assert_allclose(grad.asnumpy(), expected, rtol=1e-5, atol=1e-6)
        runs.append([g.asnumpy() for s in stages for g in s.grads])
    assert all(np.array_equal(a, b) for a, b in zip(*runs, strict=True))
