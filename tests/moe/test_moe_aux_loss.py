"""The MoE block's optional load-balancing loss on torch (``aux_loss_coef``): in a
pipeline run its gradient is added inside the block's backward, scaled like the loss
(the backward seed, 1/M, then FSDP's dp mean), per (replica, micro) chunk, over the
block's own tokens, so every gradient (the router's among them) equals the unsplit
model's with each chunk's term added to its loss (rtol 1e-5), with expert parallelism
and without; each rank reports its blocks' term. Off (the default), the block adds no
operation and the run has no expert runner.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ppswap import PipelineStage, run_schedule
from ppswap.fsdp import DeviceMesh
from ppswap.moe.runner import ExpertRunner

torch = pytest.importorskip("torch")

from moe_support import (  # noqa: E402
    DIM,
    EXPERTS,
    build_modules,
    check_against_reference,
    chunked_reference,
    ep_stages,
    local_grads,
    make_data,
    mse_loss,
)

from ppswap.backends.torch.moe import MoE  # noqa: E402

COEF = 0.5


async def _run(stages: list[PipelineStage], micro: int, batch: int, **kw: Any) -> Any:
    x, y = make_data(batch)
    return await run_schedule(
        stages,
        "1f1b",
        micro_batch_num=micro,
        inputs=x,
        targets=y,
        loss_fn=mse_loss,
        pp=2,
        step_timeout=60.0,
        **kw,
    )


def _router_grads(grads: list[dict[str, torch.Tensor]]) -> list[torch.Tensor]:
    return [g for stage in grads for name, g in stage.items() if "router" in name]


def _check_the_term_moves_the_router(stage_num: int, batch: int, chunks: int) -> None:
    """The reference's router gradients with the term differ from those without it by
    far more than the tolerance (so a run that dropped the term fails the comparison)."""
    x, y = make_data(batch)
    _, plain = chunked_reference(stage_num, 2, x, y, chunks, 0.0)
    _, with_aux = chunked_reference(stage_num, 2, x, y, chunks, COEF)
    for a, b in zip(_router_grads(plain), _router_grads(with_aux), strict=True):
        assert (a - b).abs().max() > 100 * (1e-5 * b.abs().max() + 1e-6)


@pytest.mark.asyncio
@pytest.mark.parametrize("swap", [False, True])
async def test_aux_gradient_reaches_the_router_without_ep(swap: bool) -> None:
    micro, batch = 4, 8
    modules = build_modules(2, 2, aux_loss_coef=COEF)
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(modules)]
    result = await _run(stages, micro, batch, swap=swap)
    x, y = make_data(batch)
    ref_aux, ref_grads = chunked_reference(2, 2, x, y, micro, COEF)
    for stage in stages:
        got = local_grads(stage)
        want = ref_grads[stage.stage_index]
        assert got.keys() == want.keys()
        for name, grad in got.items():
            np.testing.assert_allclose(grad, want[name].numpy(), rtol=1e-5, atol=1e-6)
    assert sum(r.aux_loss for r in result.ranks) == pytest.approx(ref_aux, rel=1e-5)
    assert all(r.aux_loss > 0 for r in result.ranks)
    _check_the_term_moves_the_router(2, batch, micro)


@pytest.mark.asyncio
async def test_aux_gradient_with_ep_is_over_each_ranks_own_tokens() -> None:
    """pp2 x dp2 x ep2, 1F1B with overlap_b_f and swap: each rank's term is over its
    own (replica, micro) chunk's tokens; the dense shards and each expert's gradients
    (the router's among the dense ones) equal the chunked reference's."""
    mesh = DeviceMesh(pp=2, dp=2, ep=2)
    micro = 2
    batch = mesh.dp * micro * 2
    stages = ep_stages(2, mesh, 2, aux_loss_coef=COEF)
    result = await _run(stages, micro, batch, swap=True, overlap_b_f=True)
    x, y = make_data(batch)
    ref_aux, ref_grads = chunked_reference(2, 2, x, y, mesh.dp * micro, COEF)
    assert check_against_reference(stages, ref_grads) == 2 * 2 * 7
    assert sum(r.aux_loss for r in result.ranks) / mesh.dp == pytest.approx(ref_aux, rel=1e-5)
    _check_the_term_moves_the_router(2, batch, mesh.dp * micro)


@pytest.mark.asyncio
async def test_off_by_default_adds_nothing() -> None:
    torch.manual_seed(0)
    block = MoE(DIM, 2 * DIM, EXPERTS)
    assert block.aux_loss_coef == 0.0
    x = torch.randn(6, DIM, requires_grad=True)
    out = block(x)
    assert block.aux_loss is None
    assert type(out.grad_fn).__name__ == "ViewBackward0"  # the block's own last op
    modules = build_modules(2, 2)
    stages = [PipelineStage(m, i, 2) for i, m in enumerate(modules)]
    assert not ExpertRunner.needed(None, stages)
    result = await _run(stages, 2, 4)
    assert [r.aux_loss for r in result.ranks] == [0.0, 0.0]


def test_the_term_changes_no_output_and_is_the_switch_form() -> None:
    torch.manual_seed(0)
    off = MoE(DIM, 2 * DIM, EXPERTS, top_k=2)
    on = MoE(DIM, 2 * DIM, EXPERTS, top_k=2, aux_loss_coef=COEF)
    on.load_state_dict(off.state_dict())
    x = torch.randn(10, DIM)
    assert torch.equal(off(x), on(x))
    probs = torch.softmax(x @ on.router.weight.T, dim=-1)
    picked, _ = on.route(x)
    fractions = torch.bincount(picked.reshape(-1), minlength=EXPERTS).float() / picked.numel()
    expected = COEF * EXPERTS * (fractions * probs.mean(0)).sum()
    assert on.aux_loss is not None
    torch.testing.assert_close(on.aux_loss, expected)


@pytest.mark.parametrize("bad", [-0.1, float("nan"), "0.1", True])
def test_a_bad_coefficient_is_refused_naming_it(bad: object) -> None:
    with pytest.raises(ValueError, match=r"aux_loss_coef must be a finite number >= 0"):
        MoE(DIM, 2 * DIM, EXPERTS, aux_loss_coef=bad)  # type: ignore[arg-type]
