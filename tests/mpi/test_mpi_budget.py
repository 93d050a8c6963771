"""memory_budget over MPI, one process per rank (``scripts/run_budget.py``, MindSpore).

Every rank's measured peak of saved bytes is within its budget (half its keep-everything
peak, and recompute-everything's peak), its chunk policies are the in-process plan's,
losses and gradients are bit-identical to keeping everything, and every rank's gradients
to the same budget's run in one process: GPipe, 1F1B, 1F1B + overlap_b_f and Interleaved
at ``mpiexec -n 2``, 1F1B at ``-n 3``.
"""

from __future__ import annotations

import re

import pytest
from test_mpi_transport import SCRIPTS, launch, needs_mpiexec

pytestmark = [pytest.mark.mpi, pytest.mark.slow]

CASES_BY_RANKS = {2: ["gpipe", "1f1b", "1f1b-overlap", "interleaved"], 3: ["1f1b"]}
BUDGETS = ("50%", "recompute-all")


@needs_mpiexec
@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", sorted(CASES_BY_RANKS))
def test_budget_met_and_bit_identical_across_processes(ranks: int) -> None:
    cases = CASES_BY_RANKS[ranks]
    result = launch(ranks, str(SCRIPTS / "run_budget.py"), *cases, timeout_s=240)
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
    for case in cases:  # the budgets bind: some rank swaps or recomputes in every case
        used = {p for _, c, _, _, _, policies in ok if c == case for p in policies.split(",")}
        assert used - {"keep"}, (case, result.output)
