"""memory_budget over torchrun, one process per rank (``scripts/budget.py``).

Every rank's measured peak of saved bytes is within its budget (half its keep-everything
peak, and recompute-everything's peak), its chunk policies are the in-process plan's,
losses and gradients are bit-identical to keeping everything, and every rank's gradients
to the same budget's run in one process: GPipe, 1F1B, 1F1B + overlap_b_f and Interleaved
at 2 processes, 1F1B at 3.
"""

from __future__ import annotations

import re

import pytest
from launch import launch

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.slow

CASES_BY_RANKS = {2: ["gpipe", "1f1b", "1f1b-overlap", "interleaved"], 3: ["1f1b"]}
BUDGETS = ("50%", "recompute-all")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", sorted(CASES_BY_RANKS))
def test_budget_met_and_bit_identical_across_processes(ranks: int) -> None:
    cases = CASES_BY_RANKS[ranks]
    result = launch(ranks, "budget.py", *cases, timeout_s=240)
    assert result.returncode == 0, result.output
    assert "MISMATCH" not in result.output, result.output
    ok = re.findall(
        r"^rank (\d+) case (\S+) (\S+) OK peak=(\d+) budget=(\d+) policies=(\S+)$",
        result.output,
        flags=re.MULTILINE,
    )
    assert {(int(r), c, b) for r, c, b, *_ in ok} == {
        (r, c, b) for r in range(ranks) for c in cases for b in BUDGETS
    }, result.output
    assert all(int(peak) <= int(budget) for *_, peak, budget, _ in ok)
    # the budgets bind: some rank swaps or recomputes in every case
    for case in cases:
        used = {p for _, c, _, _, _, policies in ok if c == case for p in policies.split(",")}
        assert used - {"keep"}, (case, result.output)
