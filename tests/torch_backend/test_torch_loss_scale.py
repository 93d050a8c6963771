"""``loss_scale``: every gradient of a run scaled, for float16 training with
``torch.amp.GradScaler``.

The backward inside the pipeline is seeded with ``loss_scale / micro_batch_num``, so a
power-of-two scale multiplies every gradient exactly and leaves the losses alone (on both
backends: ``tests/both_backends/test_loss_scale.py``). The README's GradScaler recipe: its scale
into the run, ``scaler.step`` unscales ``.grad`` and steps, which equals an unscaled run's
plain step bit for bit; under float16 autocast a scale too large for float16 gives
infinite gradients, and the scaler skips that step and lowers its scale. In one process
``agree_on_overflow`` only reports and ``clip_grad_norm_`` is torch's (across processes:
tests/torch_dist/test_torch_dist_optim.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch_support import Case, build_stages, run_case

from ppswap import PipelineStage
from ppswap.backends.torch.optim import agree_on_overflow, clip_grad_norm_

CASES = [
    Case("gpipe", pp=2, stage_num=2, micro=4),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4, split_dw=True, overlap_b_f=True),
]
SCALE = 1024.0


def sgd(stages: list[PipelineStage]) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for s in stages for p in s.parameters], lr=0.1)


def weights(stages: list[PipelineStage]) -> list[torch.Tensor]:
    return [p.detach().clone() for s in stages for p in s.parameters]


@pytest.mark.asyncio
async def test_a_grad_scaler_step_equals_the_unscaled_step() -> None:
    """Two steps of the README recipe against two plain steps: the same weights."""
    case = CASES[0]
    scaled_stages, plain_stages = build_stages(case.stage_num), build_stages(case.stage_num)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    scaled_optimizer, plain_optimizer = sgd(scaled_stages), sgd(plain_stages)
    for _ in range(2):
        scaled_optimizer.zero_grad()
        scale = scaler.scale(torch.ones(()))  # the scaler's current scale (and its start)
        await run_case(scaled_stages, case, swap=True, loss_scale=float(scale))
        scaler.step(scaled_optimizer)
        scaler.update()
        plain_optimizer.zero_grad()
        await run_case(plain_stages, case, swap=True)
        plain_optimizer.step()
    assert scaler.get_scale() == SCALE  # no infinite gradient: the scale stayed
    for scaled_weight, plain_weight in zip(
        weights(scaled_stages), weights(plain_stages), strict=True
    ):
        assert torch.equal(scaled_weight, plain_weight)


@pytest.mark.asyncio
async def test_float16_overflow_makes_the_scaler_skip_the_step() -> None:
    case = CASES[0]
    stages = build_stages(case.stage_num)
    before = weights(stages)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    optimizer = sgd(stages)
    scale = scaler.scale(torch.ones(()))
    with torch.autocast("cpu", dtype=torch.float16):
        result = await run_case(stages, case, swap=True, loss_scale=float(scale))
    assert all(torch.isfinite(torch.tensor(result.losses)))
    assert any(not torch.isfinite(p.grad).all() for s in stages for p in s.parameters)
    scaler.step(optimizer)  # skipped: a gradient is not finite
    scaler.update()
    assert scaler.get_scale() == 2.0**99
    assert all(torch.equal(a, b) for a, b in zip(weights(stages), before, strict=True))


@pytest.mark.asyncio
async def test_agree_on_overflow_in_one_process_reports_and_leaves_the_gradients() -> None:
    """Without torch.distributed (every stage here, one scaler sees every gradient) it is
    this process's verdict and changes nothing; across processes: tests/torch_dist."""
    case = CASES[0]
    stages = build_stages(case.stage_num)
    params = [p for s in stages for p in s.parameters]
    await run_case(stages, case, swap=True)
    grads = [p.grad.clone() for p in params]
    assert agree_on_overflow(params) is False
    params[-1].grad[0] = float("inf")
    assert agree_on_overflow(params) is True
    params[-1].grad[0] = grads[-1][0]
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    assert agree_on_overflow([torch.zeros(3)]) is False  # no gradient: nothing overflowed
    with pytest.raises(TypeError, match="parameters must be torch tensors, got str at index 1"):
        agree_on_overflow([params[0], "weight"])  # type: ignore[list-item]


@pytest.mark.asyncio
async def test_clip_grad_norm_in_one_process_is_torchs() -> None:
    """Without torch.distributed it is ``torch.nn.utils.clip_grad_norm_`` over the stages'
    gradients, bit for bit; bad arguments are refused before any gradient changes."""
    case = CASES[0]
    stages = build_stages(case.stage_num)
    params = [p for s in stages for p in s.parameters]
    await run_case(stages, case, swap=True)
    grads = [p.grad.clone() for p in params]
    for max_norm, norm_type in ((-1.0, 2.0), (math.inf, 2.0), ("1", 2.0), (1.0, 0.0), (1.0, True)):
        with pytest.raises(ValueError, match="allowed"):
            clip_grad_norm_(params, max_norm, norm_type)  # type: ignore[arg-type]
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads, strict=True))
    reference = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for ref, grad in zip(reference, grads, strict=True):
        ref.grad = grad.clone()
    expected = torch.nn.utils.clip_grad_norm_(reference, 0.01)
    assert torch.equal(clip_grad_norm_(params, 0.01), expected) and expected > 0.01
    assert all(torch.equal(p.grad, r.grad) for p, r in zip(params, reference, strict=True))
