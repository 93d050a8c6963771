"""memory_budget with one process per rank, by framework and launcher: torch under
``torchrun`` (2 and 3 ranks) and ``mpiexec``, MindSpore under ``mpiexec`` (2 and 3 ranks)
(in one process: ``tests/budget/test_budget_runs.py``).

The script (``tests/torch_dist/scripts/budget.py`` for torch, with dropout;
``tests/mpi/scripts/run_budget.py`` for MindSpore; both check with
``tests/budget_checks.py``) calibrates a cost model and the budgets
from runs of the whole pipeline in its own process (half each rank's keep-everything peak,
and recompute-everything's peak), then runs GPipe, 1F1B, 1F1B + overlap_b_f and
Interleaved (1F1B alone at 3 ranks) under each budget across the processes. Each rank
checks that its measured peak of saved bytes is within its budget, that its policies are
the in-process plan's, that losses and gradients are bit-identical to keeping everything,
and (rank 0) that every rank's gradients are bit-identical to the same budget's run in one
process; it prints one OK line per case and budget. Here: every rank printed every line,
every peak is within its budget, and in every case some rank swaps or recomputes.
"""

from __future__ import annotations

import re

import pytest
from launchers import REPO, launch, launcher_param

pytestmark = pytest.mark.slow

SCRIPTS = {
    "torch": REPO / "tests" / "torch_dist" / "scripts" / "budget.py",
    "mindspore": REPO / "tests" / "mpi" / "scripts" / "run_budget.py",
}
EVERY_CASE = ("gpipe", "1f1b", "1f1b-overlap", "interleaved")
BUDGETS = ("50%", "recompute-all")
RUNS = [
    launcher_param("torchrun", "torch", 2, EVERY_CASE, id="torch-torchrun-2"),
    launcher_param("torchrun", "torch", 3, ("1f1b",), id="torch-torchrun-3"),
    launcher_param("mpiexec", "torch", 2, ("1f1b-overlap",), id="torch-mpiexec-2"),
    launcher_param(
        "mpiexec",
        "mindspore",
        2,
        EVERY_CASE,
        marks=[pytest.mark.mindspore],
        id="mindspore-mpiexec-2",
    ),
    launcher_param(
        "mpiexec",
        "mindspore",
        3,
        ("1f1b",),
        marks=[pytest.mark.mindspore],
        id="mindspore-mpiexec-3",
    ),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("launcher", "framework", "ranks", "cases"), RUNS)
def test_budget_met_and_bit_identical_across_processes(
    launcher: str, framework: str, ranks: int, cases: tuple[str, ...]
) -> None:
    # the torch script serves both launchers: its first argument names the transport
    transport = () if framework == "mindspore" else ("mpi" if launcher == "mpiexec" else "torch",)
    result = launch(launcher, ranks, SCRIPTS[framework], *transport, *cases, timeout_s=240)
    assert result.returncode == 0, result.output
    assert "MISMATCH" not in result.output, result.output
    ok = re.findall(
        r"^rank (\d+) case (\S+) (\S+) OK peak=(\d+) budget=(\d+) policies=(\S+)$",
        result.output,
        flags=re.MULTILINE,
    )
    assert sorted((int(r), c, b) for r, c, b, *_ in ok) == sorted(
        (r, c, b) for r in range(ranks) for c in cases for b in BUDGETS
    ), result.output
    assert all(int(peak) <= int(budget) for *_, peak, budget, _ in ok)
    for case in cases:  # the budgets bind: some rank swaps or recomputes in every case
        used = {p for _, c, _, _, _, policies in ok if c == case for p in policies.split(",")}
        assert used - {"keep"}, (case, result.output)
