"""MindSpore's autograd seam: forwards recorded now, backwards later in any order, with
gradients bit-identical to ``mindspore.vjp`` (which only allows LIFO order)."""

from __future__ import annotations

import itertools

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn, ops

from ppswap.backends.mindspore import BACKEND as MINDSPORE

MICROS = 3


def _block() -> nn.Cell:
    ms.set_seed(3)
    return nn.SequentialCell([nn.Dense(8, 16), nn.Tanh(), nn.Dense(16, 8)])


def _inputs() -> list[Tensor]:
    rng = np.random.default_rng(5)
    return [Tensor(rng.standard_normal((4, 8)).astype(np.float32)) for _ in range(MICROS)]


def _vjp_reference(block: nn.Cell, xs: list[Tensor], sens: Tensor) -> list[list[np.ndarray]]:
    """Per micro-batch: dx then every dw, from ms.vjp (forward and backward back to back)."""
    weights = block.trainable_params()
    grads = []
    for x in xs:
        _, vjp_fn = ms.vjp(lambda t: block(t), x, weights=weights)
        dx, dw = vjp_fn(sens)
        dx = dx[0] if isinstance(dx, tuple) else dx
        grads.append([dx.asnumpy(), *(g.asnumpy() for g in dw)])
    return grads


@pytest.mark.parametrize("order", list(itertools.permutations(range(MICROS))))
def test_backwards_in_any_order_equal_vjp_bit_for_bit(order: tuple[int, ...]) -> None:
    block = _block()
    xs = _inputs()
    sens = ops.ones((4, 8), ms.float32) * 0.5
    expected = _vjp_reference(block, xs, sens)
    weights = block.trainable_params()

    def forward(x: Tensor) -> Tensor:
        out: Tensor = block(x)
        return out

    autograd = MINDSPORE.autograd
    records = [autograd.record(forward, (x,))[1] for x in xs]  # F0 F1 F2 outstanding
    for micro in order:
        (dx,), dw = autograd.backward(records[micro], sens, weights)
        got = [dx.asnumpy(), *(g.asnumpy() for g in dw)]
        for a, b in zip(expected[micro], got, strict=True):
            assert np.array_equal(a, b), f"micro {micro} of order {order}"


def test_the_split_backward_keeps_dw_for_later() -> None:
    block = _block()
    (x,) = _inputs()[:1]
    sens = ops.ones((4, 8), ms.float32)
    weights = block.trainable_params()

    def forward(t: Tensor) -> Tensor:
        out: Tensor = block(t)
        return out

    autograd = MINDSPORE.autograd
    full_dx, full_dw = autograd.backward(autograd.record(forward, (x,))[1], sens, weights)
    (dx,), pending = autograd.backward_input(autograd.record(forward, (x,))[1], sens, weights)
    assert np.array_equal(dx.asnumpy(), full_dx[0].asnumpy())
    for a, b in zip(pending(), full_dw, strict=True):
        assert np.array_equal(a.asnumpy(), b.asnumpy())
