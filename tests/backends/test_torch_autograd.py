"""torch's autograd seam: an input whose dx is not wanted (the first stage's input, the
loss's target) gets no gradient computed, and the weight gradients do not change."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from ppswap.backends.torch import BACKEND as TORCH  # noqa: E402


def _block() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def test_an_input_without_wanted_grad_is_not_differentiated() -> None:
    block = _block()
    weights = list(block.parameters())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    target = torch.randn(4, 8, generator=torch.Generator().manual_seed(6))
    sens = torch.tensor(0.5)

    def forward(inputs: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(block(inputs), y)

    _, every = TORCH.autograd.record(forward, (x, target))
    every_dx, every_dw = TORCH.autograd.backward(every, sens, weights)
    assert every_dx[0] is not None and every_dx[1] is not None

    _, weights_only = TORCH.autograd.record(forward, (x, target), (False, False))
    assert not any(t.requires_grad for t in weights_only.inputs)  # type: ignore[attr-defined]
    dx, dw = TORCH.autograd.backward(weights_only, sens, weights)
    assert dx == (None, None)
    for got, expected in zip(dw, every_dw, strict=True):
        assert torch.equal(got, expected)


def test_grad_inputs_must_match_the_inputs() -> None:
    with pytest.raises(ValueError, match="grad_inputs has 1 flags for 2 inputs"):
        TORCH.autograd.record(torch.add, (torch.ones(2), torch.ones(2)), (True,))


def test_add_into_adds_in_place_bit_identically() -> None:
    generator = torch.Generator().manual_seed(7)
    parts = [torch.randn(64, 64, generator=generator) for _ in range(5)]
    expected = parts[0] + parts[1]
    for part in parts[2:]:
        expected = expected + part
    total = parts[0] + parts[1]
    first = total
    for part in parts[2:]:
        total = TORCH.add_into(total, part)
    assert total is first  # no allocation per micro-batch
    assert torch.equal(total, expected)
