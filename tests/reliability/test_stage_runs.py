"""A run changes its stages only when it succeeds: a failed or cancelled run leaves them as
they were.

What a run changes of a stage (gradients accumulated so far, forwards waiting for their
backward, pending dw, the random-number stream) lives in that run's ``StageRun``; the
stage's ``grads`` and ``generation`` are set at the end of a successful run. So after a
training run, a run that fails or is cancelled halfway through its backwards (some
gradients accumulated, others not, chunks still recorded) leaves the first run's gradient
tensors on the stage, the very objects, and the next run gives a fresh stage's losses and
gradients bit for bit.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from reliability_support import (
    GPIPE,
    INTERLEAVED,
    Case,
    assert_clean,
    assert_same_grads,
    failure_of,
    grads_of,
    live_swap_objects,
    make_data,
    make_stages,
    reference,
    run_case,
)

from ppswap import StepKind
from ppswap.core.faults import FaultPlan, FaultRule, call_at, fail_compute
from ppswap.swap import EmulatedDevice


def _last_backward(case: Case) -> tuple[StepKind, int]:
    """The backward kind of rank 0 and its last micro-batch: where the run ends, with
    every other backward of the run done (GPipe) or well under way (Interleaved)."""
    return (StepKind.BWD_INPUT if case.split_dw else StepKind.BWD), case.micro - 1


@pytest.mark.timeout(180)
@pytest.mark.asyncio
@pytest.mark.parametrize("case", [GPIPE, INTERLEAVED], ids=["gpipe", "interleaved_dxdw"])
@pytest.mark.parametrize("ending", ["failed", "cancelled"])
async def test_an_unfinished_run_leaves_the_stages_as_they_were(case: Case, ending: str) -> None:
    expected_losses, expected_grads = await reference(case)
    stages = make_stages(case.stage_num)
    device = EmulatedDevice()
    baseline = live_swap_objects()
    # A first run on other data: gradients unlike the reference's and the second run's.
    x, y = make_data(seed=7)
    await run_case(stages, case, inputs=x, targets=y, device=device)
    before = [stage.grads for stage in stages]
    before_values = grads_of(stages)
    parameters = [stage.parameters for stage in stages]
    assert not any(np.array_equal(a, b) for a, b in zip(before_values, expected_grads, strict=True))

    kind, micro = _last_backward(case)
    if ending == "failed":
        rule: FaultRule = fail_compute(kind, rank=0, micro=micro)
        failure = await failure_of(run_case(stages, case, faults=FaultPlan((rule,)), device=device))
        assert (failure.rank, failure.actor) == (0, "compute")
    else:
        with anyio.CancelScope() as scope:
            rule = call_at(scope.cancel, kind, rank=0, micro=micro)
            await run_case(stages, case, faults=FaultPlan((rule,)), device=device)
        assert scope.cancelled_caught

    assert_clean(stages, device, baseline)
    for stage, grads, params in zip(stages, before, parameters, strict=True):
        assert stage.generation == 1
        assert all(now is then for now, then in zip(stage.parameters, params, strict=True))
        assert all(now is then for now, then in zip(stage.grads, grads, strict=True))
    assert_same_grads(before_values, grads_of(stages))

    result = await run_case(stages, case, device=device)
    assert result.generation == 2 and all(stage.generation == 2 for stage in stages)
    assert result.losses == expected_losses
    assert_same_grads(expected_grads, grads_of(stages))
    assert_clean(stages, device, baseline)
