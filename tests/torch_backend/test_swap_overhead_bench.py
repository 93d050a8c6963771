"""``benchmarks/bench_swap_overhead.py`` runs end to end, with the contending thread that
imitates a pipeline's event loop, and reports every phase; no timing is judged here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.timeout(120)
def test_the_overhead_benchmark_reports_every_phase_beside_a_contending_thread() -> None:
    command = [sys.executable, "benchmarks/bench_swap_overhead.py", "--sessions", "2"]
    command += ["--repeats", "1", "--contend-us", "20", "--contend-period-us", "100"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    for phase in ("forward", "offload", "load", "backward", "release"):
        assert re.search(rf"^\| {phase} \| \d+ \| \d+ \| [+-]\d+ \|$", result.stdout, re.M)
    added = re.search(
        r"23 storages moved \(width 16, 1 x 4 tokens\); swap adds (\d+) us", result.stdout
    )
    assert added is not None and int(added.group(1)) > 0, result.stdout
    assert "A thread ran 20 us of Python every 100 us beside them." in result.stdout
    floor = re.search(
        r"the forward takes (\d+) us, [+-]\d+ us over no swap, against [+-]\d+ us with swap; "
        r"the chunk (\d+) us, [+-]\d+ us over no swap, against [+-]\d+ us with swap "
        r"\(offload \d+, load \d+, backward [+-]\d+ us\)",
        result.stdout,
    )
    assert floor is not None and int(floor.group(1)) > 0, result.stdout
    assert int(floor.group(2)) > int(floor.group(1)), result.stdout


@pytest.mark.timeout(120)
def test_the_overhead_benchmark_runs_at_the_peer_models_own_size() -> None:
    command = [sys.executable, "benchmarks/bench_swap_overhead.py", "--sessions", "1"]
    command += ["--repeats", "1", "--model", "small"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0, result.stdout + result.stderr
    added = re.search(
        r"23 storages moved \(width 128, 8 x 16 tokens\); swap adds (\d+) us", result.stdout
    )
    assert added is not None and int(added.group(1)) > 0, result.stdout


def test_the_contention_options_are_checked_before_any_work() -> None:
    command = [sys.executable, "benchmarks/bench_swap_overhead.py", "--contend-us", "-5"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "--contend-us must be >= 0 and --contend-period-us > 0, got -5.0" in result.stderr
