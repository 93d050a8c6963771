"""The caller's ``torch.autocast`` around ``run_schedule`` reaches the stages' forwards.

Autocast is per thread and the stages run on the runtime's compute thread, so without
``Backend.caller_forward_scope`` (``ppswap/backends/torch/caller.py``) the usual
mixed-precision step, ``with torch.autocast(...): await run_schedule(...)``, would run the
pipeline in float32 without a word. Checked here: every forward and the loss run under the
caller's autocast on the compute thread and no backward does; runs of every schedule
family, and FSDP dp2, equal a micro-batch-by-micro-batch reference under the same
autocast, swap on bit-identical to swap off; forward-only outputs are the autocast
forward's; a disabled autocast changes nothing. Across processes: the ``-autocast`` cases
of ``tests/torch_dist``. (The current CUDA device, carried the same way, needs a GPU:
``benchmarks/gpu_check.py`` runs through it.)
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch_support import (
    Case,
    build_modules,
    build_stages,
    grads_of,
    make_data,
    mse_loss,
    run_case,
    sharded_stages,
)

from ppswap import PipelineStage, RunResult
from ppswap.fsdp import DeviceMesh, full_gradients

CASES = [
    Case("gpipe", pp=2, stage_num=2, micro=4),
    Case("1f1b", pp=4, stage_num=4, micro=8, split_dw=True, p2p="boundary"),
    Case("interleaved_1f1b", pp=2, stage_num=4, micro=4, overlap_b_f=True, p2p="batch"),
]
RTOL = 1e-5


@contextmanager
def bfloat16_autocast() -> Iterator[None]:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yield


# -- where autocast applies -----------------------------------------------------------------


class Seen:
    """What the forwards, the loss and the backwards saw: (autocast on, its dtype, thread)."""

    def __init__(self) -> None:
        self.forward: list[tuple[bool, torch.dtype, int]] = []
        self.loss: list[tuple[bool, torch.dtype, int]] = []
        self.backward: list[bool] = []

    @staticmethod
    def now() -> tuple[bool, torch.dtype, int]:
        return (
            torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"),
            threading.get_ident(),
        )


class BackwardProbe(torch.autograd.Function):
    """The identity; its backward notes whether autocast is on where it runs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seen: Seen) -> torch.Tensor:
        ctx.seen = seen
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.seen.backward.append(torch.is_autocast_enabled("cpu"))
        return grad, None


class Probed(nn.Module):
    def __init__(self, inner: nn.Module, seen: Seen) -> None:
        super().__init__()
        self.inner, self.seen = inner, seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.forward.append(Seen.now())
        out: torch.Tensor = BackwardProbe.apply(self.inner(x), self.seen)
        return out


async def probed_run(seen: Seen, *, autocast: bool) -> RunResult:
    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        seen.loss.append(Seen.now())
        return mse_loss(output, target)

    stages = [PipelineStage(Probed(m, seen), i, 2) for i, m in enumerate(build_modules(2))]
    with bfloat16_autocast() if autocast else nullcontext():
        return await run_case(stages, CASES[0], swap=True, loss_fn=loss_fn)


@pytest.mark.asyncio
async def test_the_callers_autocast_reaches_every_forward_and_the_loss_but_no_backward() -> None:
    seen = Seen()
    await probed_run(seen, autocast=True)
    caller = threading.get_ident()
    assert len(seen.forward) == 2 * CASES[0].micro and len(seen.loss) == CASES[0].micro
    for enabled, dtype, thread in seen.forward + seen.loss:
        assert (enabled, dtype) == (True, torch.bfloat16)
        assert thread != caller  # the compute thread: autocast did not come with it
    assert len(seen.backward) == 2 * CASES[0].micro and not any(seen.backward)
    assert not torch.is_autocast_enabled("cpu")  # and the caller's is as it was


@pytest.mark.asyncio
async def test_without_autocast_the_forwards_run_without_it() -> None:
    seen = Seen()
    await probed_run(seen, autocast=False)
    assert seen.forward and not any(enabled for enabled, _, _ in seen.forward + seen.loss)


@pytest.mark.asyncio
async def test_a_disabled_autocast_changes_nothing() -> None:
    base = await run_case(build_stages(2), CASES[0], swap=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        disabled = await run_case(build_stages(2), CASES[0], swap=True)
    assert disabled.losses == base.losses


# -- numerics --------------------------------------------------------------------------------


def micro_reference(
    modules: Sequence[nn.Module], micro: int
) -> tuple[list[float], list[list[torch.Tensor]]]:
    """One process, no pipeline: micro-batch after micro-batch, each forward and its loss
    under the same autocast, each backward outside it seeded with 1 / micro (as the last
    stage seeds it); the gradients accumulate in ``.grad``."""
    x, y = make_data()
    losses = []
    for xm, ym in zip(
        torch.from_numpy(x).chunk(micro), torch.from_numpy(y).chunk(micro), strict=True
    ):
        with bfloat16_autocast():
            out = xm
            for module in modules:
                out = module(out)
            loss = mse_loss(out, ym)
        loss.backward(torch.full_like(loss, 1.0 / micro))
        losses.append(float(loss.detach()))
    grads = [
        [p.grad.detach().clone() for p in m.parameters() if p.grad is not None] for m in modules
    ]
    return losses, grads


@pytest.mark.asyncio
@pytest.mark.parametrize("case", CASES, ids=Case.label)
async def test_autocast_runs_equal_the_reference_and_swap_is_bit_identical(case: Case) -> None:
    runs = []
    for swap in (False, True):
        stages = build_stages(case.stage_num)
        with bfloat16_autocast():
            runs.append((stages, await run_case(stages, case, swap=swap)))
    (off_stages, off), (on_stages, on) = runs
    assert on.losses == off.losses
    for grads_off, grads_on in zip(grads_of(off_stages), grads_of(on_stages), strict=True):
        for g_off, g_on in zip(grads_off, grads_on, strict=True):
            assert g_off.dtype == torch.float32 and torch.equal(g_off, g_on)

    ref_losses, ref_grads = micro_reference(build_modules(case.stage_num, wrap=False), case.micro)
    assert on.losses == pytest.approx(ref_losses, rel=RTOL)
    for grads, refs in zip(grads_of(on_stages), ref_grads, strict=True):
        for grad, ref in zip(grads, refs, strict=True):
            torch.testing.assert_close(grad, ref, rtol=RTOL, atol=1e-6)

    assert sum(r.offloaded_bytes for r in on.ranks) > 0
    # (the reference is no float32 run: within RTOL of it only if autocast applied)
    full = await run_case(build_stages(case.stage_num), case, swap=False)
    assert full.losses != pytest.approx(ref_losses, rel=RTOL)


@pytest.mark.asyncio
async def test_fsdp_dp2_under_autocast_swaps_bit_identically_and_matches_the_reference() -> None:
    """pp2 x dp2: the unsharded weights cast in each forward; the full gradients (both
    replicas' halves of the batch) equal the reference's under the same autocast."""
    case = CASES[0]
    mesh = DeviceMesh(pp=2, dp=2)
    runs = []
    for swap in (False, True):
        stages = sharded_stages(case.stage_num, mesh)
        with bfloat16_autocast():
            result = await run_case(stages, case, swap=swap, pp=2)
        full = [full_gradients([s for s in stages if s.stage_index == i]) for i in range(2)]
        runs.append((result, full))
    (off, full_off), (on, full_on) = runs
    assert on.losses == off.losses and sum(r.offloaded_bytes for r in on.ranks) > 0
    for stage_off, stage_on in zip(full_off, full_on, strict=True):
        assert all(np.array_equal(a, b) for a, b in zip(stage_off, stage_on, strict=True))
    # each replica's mean over its micro-batches, averaged: the mean over all of them
    _, ref_grads = micro_reference(build_modules(case.stage_num, wrap=False), 2 * case.micro)
    for stage_full, refs in zip(full_on, ref_grads, strict=True):
        for grad, ref in zip(stage_full, refs, strict=True):
            np.testing.assert_allclose(grad, ref.numpy(), rtol=RTOL, atol=1e-6)


@pytest.mark.asyncio
async def test_forward_only_outputs_are_the_autocast_forward() -> None:
    """Inference under autocast: each micro-batch's output is the unsplit forward's under
    the same autocast, bit for bit, and not the float32 one."""
    x, _ = make_data()
    micro = CASES[0].micro

    async def outputs() -> list[Any]:
        overrides = {"forward_only": True, "loss_fn": None, "targets": None}
        result = await run_case(build_stages(2), CASES[0], swap=False, **overrides)
        return list(result.outputs)

    with bfloat16_autocast():
        mixed = await outputs()
        modules = build_modules(2, wrap=False)
        with torch.no_grad():
            expected = [modules[1](modules[0](xm)) for xm in torch.from_numpy(x).chunk(micro)]
    plain = await outputs()
    assert len(mixed) == micro
    for got, want, full in zip(mixed, expected, plain, strict=True):
        assert np.array_equal(got, want.numpy())
        assert not np.array_equal(got, full)
