"""Tied parameters on MindSpore, in one process (``ppswap/planning/ties.py``, ``tie_sum.py``;
the torch twin with more schedules, FSDP and the refusals:
``tests/torch_backend/test_torch_tied.py``; across processes:
``tests/across_processes/test_tied.py``).

A GPT-2 style model (``tied_cells.py``): the first stage projects its input by ``wte``,
the last multiplies its hidden state by ``wte``'s transpose (the head). Held as one
Parameter object by both stages (found by identity) or as two declared copies: the loss
and every gradient equal the unsplit model's (rtol 1e-5), both holders' ``stage.grads``
entries are the whole gradient, bit for bit the same, and swap on is bit-identical to
swap off; under GPipe, Interleaved, 1F1B with the dx/dw split and Interleaved with
overlap_b_f.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from tied_cells import cells, data, declared, tied_index, unsplit

from ppswap import PipelineStage, run_schedule
from ppswap.demo.model import mse_loss

CASES: dict[str, tuple[str, int, int, dict[str, Any]]] = {
    "gpipe-pp2": ("gpipe", 2, 2, {}),
    "interleaved-pp2-vpp2": ("interleaved_1f1b", 2, 4, {}),
    "1f1b-pp2-split-dw": ("1f1b", 2, 2, {"split_dw": True}),
    "interleaved-pp2-overlap": ("interleaved_1f1b", 2, 4, {"overlap_b_f": True}),
}


@pytest.mark.timeout(240)
@pytest.mark.asyncio
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("how", ["shared", "declared"])
async def test_a_tied_model_equals_the_unsplit_one(case: str, how: str) -> None:
    schedule, pp, stage_num, extra = CASES[case]
    want_loss, want = unsplit(stage_num)
    runs = []
    for swap in (False, True):
        modules = cells(stage_num, shared=how == "shared")
        stages = [
            PipelineStage(
                m, i, stage_num, tied=declared(i, stage_num) if how == "declared" else None
            )
            for i, m in enumerate(modules)
        ]
        x, y = data()
        options: dict[str, Any] = {"pp": pp, "micro_batch_num": 4, "step_timeout": 120, **extra}
        result = await run_schedule(
            stages, schedule, inputs=x, targets=y, loss_fn=mse_loss, swap=swap, **options
        )
        assert result.loss == pytest.approx(want_loss, rel=1e-5)
        first, last = stages[0], stages[-1]
        k_first = tied_index(first.module, first.parameters)
        k_last = tied_index(last.module, last.parameters)
        assert np.array_equal(first.grads[k_first].asnumpy(), last.grads[k_last].asnumpy())
        # the unsplit model's gradients (its head is the embedding's object)
        for stage, reference in zip(stages, want, strict=True):
            for grad, expected in zip(stage.grads, reference, strict=True):
                np.testing.assert_allclose(grad.asnumpy(), expected, rtol=1e-5, atol=1e-6)
        runs.append([g.asnumpy() for s in stages for g in s.grads])
    assert all(np.array_equal(a, b) for a, b in zip(*runs, strict=True))
