"""Failures and cancellations of torch runs leave nothing behind; the same stages then run
again bit-identically. A saved tensor modified in place during a run is refused.

The reference of a configuration is a run on fresh stages built from the same seed (see
tests/reliability/ for the MindSpore versions, with many more sites).
"""

from __future__ import annotations

import anyio
import pytest
import torch
from torch import nn
from torch_support import (
    DIM,
    Case,
    assert_clean,
    build_modules,
    build_stages,
    grads_of,
    leftovers,
    run_case,
)

from ppswap import PipelineError, PipelineStage, StepKind
from ppswap.backends.torch.hooks import SavedTensorModifiedError
from ppswap.core.faults import FaultPlan, FaultRule, InjectedFault, call_at, fail_compute, fail_copy
from ppswap.swap import EmulatedDevice, SwapError, swap_wrapper

GPIPE = Case("gpipe", pp=2, stage_num=2, micro=4)
INTERLEAVED_DW = Case("interleaved_1f1b", pp=2, stage_num=4, micro=4, split_dw=True)

_REFERENCE: dict[Case, tuple[list[float], list[list[torch.Tensor]]]] = {}


async def _reference(case: Case) -> tuple[list[float], list[list[torch.Tensor]]]:
    if case not in _REFERENCE:
        stages = build_stages(case.stage_num)
        result = await run_case(stages, case, swap=True)
        _REFERENCE[case] = (result.losses, grads_of(stages))
    return _REFERENCE[case]


async def _runs_again_identically(
    stages: list[PipelineStage],
    case: Case,
    device: EmulatedDevice,
    baseline: tuple[int, int, int],
) -> None:
    expected_losses, expected_grads = await _reference(case)
    result = await run_case(stages, case, swap=True, device=device)
    assert result.losses == expected_losses
    for stage_e, stage_a in zip(expected_grads, grads_of(stages), strict=True):
        assert all(torch.equal(e, a) for e, a in zip(stage_e, stage_a, strict=True))
    assert all(r.offloaded_bytes > 0 for r in result.ranks)
    assert_clean(stages, device, baseline)


@pytest.mark.timeout(60)
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("rule", "rank", "actor", "step"),
    [
        (fail_compute(StepKind.BWD, rank=1, stage=1, micro=2), 1, "compute", "B2.1"),
        (fail_copy("load", rank=0, stage=0, micro=1), 0, "copy", "LL1.0"),
    ],
    ids=["backward", "load-copy"],
)
async def test_a_failure_is_named_leaves_nothing_and_the_stages_run_again(
    rule: FaultRule, rank: int, actor: str, step: str
) -> None:
    """An injected failure (a backward, a load copy) ends the run as one PipelineError
    naming rank, actor and step; no thread, task, swap group, chunk, recorded graph or
    lent host buffer survives it; the same stages then give the reference bit for bit."""
    await _reference(GPIPE)
    stages = build_stages(GPIPE.stage_num)
    device = EmulatedDevice()
    baseline = leftovers()
    with pytest.raises(PipelineError) as caught:
        await run_case(
            stages, GPIPE, swap=True, faults=FaultPlan((rule,)), device=device, step_timeout=20.0
        )
    where = (caught.value.rank, caught.value.actor, caught.value.step)
    cause = type(caught.value.__cause__)
    del caught  # its traceback pins the run's frames
    assert where == (rank, actor, step)
    assert cause is InjectedFault
    assert_clean(stages, device, baseline)
    await _runs_again_identically(stages, GPIPE, device, baseline)


@pytest.mark.timeout(60)
@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("case", "kind", "rank", "micro"),
    [
        (GPIPE, StepKind.SWAP_WAIT_OFFLOAD, 0, 0),
        # With the dx/dw split some chunks hold their graph until BWD_WEIGHT.
        (INTERLEAVED_DW, StepKind.BWD_WEIGHT, 0, 1),
    ],
    ids=["gpipe-at-offload-wait", "interleaved-dw-at-weight-grad"],
)
async def test_a_cancellation_leaves_nothing_and_the_stages_run_again(
    case: Case, kind: StepKind, rank: int, micro: int
) -> None:
    """Cancelling the caller's scope when a rank reaches a step stops the run; nothing is
    left behind and the same stages then give the reference bit for bit."""
    await _reference(case)
    stages = build_stages(case.stage_num)
    device = EmulatedDevice()
    baseline = leftovers()
    with anyio.CancelScope() as scope:
        plan = FaultPlan((call_at(scope.cancel, kind, rank=rank, micro=micro),))
        await run_case(stages, case, swap=True, faults=plan, device=device)
    assert scope.cancelled_caught
    assert_clean(stages, device, baseline)
    await _runs_again_identically(stages, case, device, baseline)


class _Mutator(nn.Module):
    """User code torch refuses: keeps its last saved tanh output and halves it in place
    during the next forward (the previous micro-batch's backward would read it)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(DIM, DIM)
        self.previous: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.fc(x))
        if self.previous is not None:
            self.previous.mul_(0.5)
        self.previous = hidden.detach()
        return hidden


@pytest.mark.timeout(60)
@pytest.mark.asyncio
@pytest.mark.parametrize("swap", [False, True], ids=["swap-off", "swap-on"])
async def test_a_saved_tensor_modified_in_place_during_a_run_is_refused(swap: bool) -> None:
    """Without swap the backward that would read the modified tensor is refused
    (SavedTensorModifiedError; torch's own check is off under saved-tensor hooks). With
    swap (the module wrapped, its chunk offloaded) the swap layer refuses to drop the
    device tensor after the write (SwapError naming the tensor). Either way the run ends
    as a PipelineError of the last rank and leaves nothing behind."""
    first = build_modules(2)[0]
    last: nn.Module = swap_wrapper(_Mutator()) if swap else _Mutator()
    stages = [PipelineStage(first, 0, 2), PipelineStage(last, 1, 2)]
    device = EmulatedDevice()
    baseline = leftovers()
    with pytest.raises(PipelineError) as caught:
        await run_case(stages, GPIPE, swap=swap, device=device, step_timeout=20.0)
    rank, step, message = caught.value.rank, caught.value.step, str(caught.value)
    cause = caught.value.__cause__
    del caught
    assert rank == 1
    assert "version 0 -> 1" in message
    if swap:
        assert isinstance(cause, SwapError) and not isinstance(cause, SavedTensorModifiedError)
        assert step is not None and step.startswith("WO")  # SWAP_WAIT_OFFLOAD
        assert "tensor '_Mutator" in message and "refusing to offload" in message
    else:
        assert isinstance(cause, SavedTensorModifiedError)
        assert step is not None and step.startswith("B")
        assert "modified in place after its forward saved it" in message
    del cause
    assert_clean(stages, device, baseline)
