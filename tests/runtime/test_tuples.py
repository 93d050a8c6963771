"""Several tensors between stages on MindSpore: a stage returns a tuple, the next is called
with its elements (the torch twin: ``tests/torch_backend/test_torch_tuples.py``).

The model (``ppswap.demo.model.TupleStage``) passes ``(hidden, mask, scale)`` along:
``mask`` an int32 tensor (no gradient travels back for it), ``scale`` a float tensor every
stage uses and changes. For GPipe, 1F1B and Interleaved with dx/dw split and overlap:
swap on bit-identical to swap off, both equal to the unsplit model (rtol 1e-5), bytes
moved; a forward-only run passes the tuples too, with the training run's losses, and
without ``loss_fn`` returns the last stage's outputs; targets given as a tuple reach
``loss_fn`` as one, and a batch given as a dict reaches the first cell as keyword
arguments.
"""

from __future__ import annotations

from typing import Any

import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, nn

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.demo.model import build_tuple_stages, mse_loss
from ppswap.swap import swap_wrapper

DIM = 8
BATCH = 8
CASES = [
    # (schedule, pp, stage_num, micro, split_dw, overlap_b_f)
    ("gpipe", 2, 2, 4, False, False),
    ("1f1b", 3, 3, 8, False, False),
    ("interleaved_1f1b", 2, 4, 4, True, True),
]


class Chain(nn.Cell):  # type: ignore[misc]
    def __init__(self, cells: list[nn.Cell]) -> None:
        super().__init__()
        self.chain = nn.CellList(cells)

    def construct(self, x: Tensor) -> Tensor:
        out: Any = self.chain[0](x)
        for cell in self.chain[1:]:
            out = cell(*out)
        return out


def cells(stage_num: int) -> list[nn.Cell]:
    return build_tuple_stages(stage_num, dim=DIM, wrap=swap_wrapper)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    return x, rng.standard_normal((BATCH, DIM)).astype(np.float32)


def unsplit(stage_num: int) -> tuple[float, list[np.ndarray]]:
    model = Chain(cells(stage_num))
    x, y = data()

    def loss() -> Tensor:
        return mse_loss(model(Tensor(x)), Tensor(y))

    value, vjp_fn = ms.vjp(loss, weights=model.trainable_params())
    _, grads = vjp_fn(Tensor(np.float32(1.0)))
    return float(value.asnumpy()), [g.asnumpy() for g in grads]


async def run(
    case: tuple[Any, ...], *, swap: bool, **overrides: Any
) -> tuple[RunResult, list[np.ndarray]]:
    """``case`` on fresh stages (``overrides``: run_schedule's keywords)."""
    schedule, pp, stage_num, micro, split_dw, overlap = case
    stages = [PipelineStage(c, i, stage_num) for i, c in enumerate(cells(stage_num))]
    x, y = data()
    options: dict[str, Any] = {
        "pp": pp,
        "micro_batch_num": micro,
        "inputs": x,
        "targets": y,
        "loss_fn": mse_loss,
        "swap": swap,
        "split_dw": split_dw,
        "overlap_b_f": overlap,
        "step_timeout": 120,
    }
    result = await run_schedule(stages, schedule, **(options | overrides))
    return result, [g.asnumpy() for s in stages for g in s.grads]


@pytest.mark.timeout(240)
@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
async def test_tuples_between_stages_swap_bit_identically_and_match_the_unsplit_model(
    case: tuple[Any, ...],
) -> None:
    off, grads_off = await run(case, swap=False)
    on, grads_on = await run(case, swap=True)
    assert on.losses == off.losses
    assert all(np.array_equal(a, b) for a, b in zip(grads_off, grads_on, strict=True))
    assert sum(rank.offloaded_bytes for rank in on.ranks) > 0
    loss, expected = unsplit(case[2])
    assert on.loss == pytest.approx(loss, rel=1e-5)
    for got, want in zip(grads_on, expected, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_forward_only_run_passes_tuples_and_gives_the_training_runs_losses() -> None:
    trained, _ = await run(CASES[2], swap=False)
    evaluated, _ = await run(
        CASES[2], swap=False, forward_only=True, split_dw=False, overlap_b_f=False
    )
    assert evaluated.losses == trained.losses


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_forward_only_run_without_loss_fn_returns_the_last_stages_outputs() -> None:
    """Inference (``tests/torch_backend/test_torch_outputs.py`` on torch): per micro-batch
    the last stage's output, equal to the unsplit model on that micro-batch."""
    schedule, pp, stage_num, micro, _, _ = CASES[1]
    stages = [PipelineStage(c, i, stage_num) for i, c in enumerate(cells(stage_num))]
    x, _ = data()
    result = await run_schedule(
        stages, schedule, pp=pp, micro_batch_num=micro, inputs=x, forward_only=True
    )
    assert result.losses == [] and len(result.outputs) == micro
    model = Chain(cells(stage_num))
    for got, part in zip(result.outputs, np.split(x, micro), strict=True):
        np.testing.assert_allclose(got, model(Tensor(part)).asnumpy(), rtol=1e-6, atol=1e-7)


def weighted_mse(output: Tensor, target: tuple[Tensor, Tensor]) -> Tensor:
    """The loss of ``targets=(y, weights)``: squared errors weighted per sample."""
    y, weights = target
    return (((output - y) ** 2) * weights).mean()


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_targets_given_as_a_tuple_reach_loss_fn_split_alike() -> None:
    """``targets=(y, weights)``: ``loss_fn`` gets a tuple of one micro-batch of each; swap
    on bit-identical to off, the loss the unsplit model's."""
    x, y = data()
    weights = (np.arange(BATCH) % 3).astype(np.float32).reshape(BATCH, 1)
    overrides = {"targets": (y, weights), "loss_fn": weighted_mse}
    off, grads_off = await run(CASES[1], swap=False, **overrides)
    on, grads_on = await run(CASES[1], swap=True, **overrides)
    assert on.losses == off.losses
    assert all(np.array_equal(a, b) for a, b in zip(grads_off, grads_on, strict=True))
    model = Chain(cells(CASES[1][2]))
    expected = float(weighted_mse(model(Tensor(x)), (Tensor(y), Tensor(weights))).asnumpy())
    assert on.loss == pytest.approx(expected, rel=1e-5)
    assert on.loss != pytest.approx(unsplit(CASES[1][2])[0], rel=1e-3)  # the weights were used


class Scaled(nn.Cell):  # type: ignore[misc]
    """A first stage taking keyword arguments: ``x``, and a per-sample ``scale``."""

    def __init__(self, inner: nn.Cell) -> None:
        super().__init__()
        self.inner = inner

    def construct(self, x: Tensor, scale: Tensor) -> Any:
        return self.inner(x * scale)


@pytest.mark.timeout(120)
@pytest.mark.asyncio
async def test_a_batch_given_as_a_dict_calls_the_first_cell_with_keywords() -> None:
    """``inputs={"scale": ..., "x": ...}``: the first stage's cell gets ``x=`` and
    ``scale=`` per micro-batch; swap on bit-identical to off, the unsplit model's loss."""
    x, y = data()
    scale = (np.arange(BATCH) % 3 + 1).astype(np.float32).reshape(BATCH, 1)
    losses = []
    for swap in (False, True):
        chain = cells(CASES[1][2])
        chain[0] = Scaled(chain[0])
        stages = [PipelineStage(c, i, len(chain)) for i, c in enumerate(chain)]
        result = await run_schedule(
            stages,
            "1f1b",
            micro_batch_num=8,
            inputs={"scale": scale, "x": x},
            targets=y,
            loss_fn=mse_loss,
            swap=swap,
            step_timeout=120,
        )
        losses.append(result.losses)
    assert losses[0] == losses[1]
    model = Chain(cells(CASES[1][2]))
    expected = float(mse_loss(model(Tensor(x * scale)), Tensor(y)).asnumpy())
    assert result.loss == pytest.approx(expected, rel=1e-5)
    assert result.loss != pytest.approx(unsplit(CASES[1][2])[0], rel=1e-3)  # the scale counts
