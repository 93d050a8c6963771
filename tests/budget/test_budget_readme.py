"""README's "Fit a memory budget" program runs as written: every rank within its budget,
losses equal to keeping everything (the program asserts it), something not kept."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.mindspore]


def test_fit_a_memory_budget_runs_as_written(tmp_path: Path) -> None:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Fit a memory budget")
    match = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert match is not None
    script = tmp_path / "budget.py"
    script.write_text(match.group(1))
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = re.findall(
        r"rank (\d): peak (\d+) <= budget (\d+) \(predicted (\d+)\), policies (.*)", done.stdout
    )
    assert [int(r[0]) for r in rows] == [0, 1, 2, 3], done.stdout
    assert all(int(peak) <= int(budget) for _, peak, budget, _, _ in rows)
    assert any("'swap'" in p or "'recompute'" in p for *_, p in rows)
