"""bench_cost's rows report the median of each measure over their runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


def load_bench_cost() -> ModuleType:
    sys.path.insert(0, str(BENCHMARKS))  # bench_cost imports bench_memory beside it
    try:
        spec = importlib.util.spec_from_file_location("bench_cost", BENCHMARKS / "bench_cost.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(BENCHMARKS))


def run(step_s: float, exposed_share: float, hidden_share: float | None) -> dict[str, object]:
    return {"step_s": step_s, "exposed_share": exposed_share, "hidden_share": hidden_share}


def test_step_time_is_the_median_of_the_runs_not_the_median_exposed_runs() -> None:
    bench_cost = load_bench_cost()
    runs = [run(3.0, 0.0, 0.9), run(1.0, 0.0, 0.7), run(2.0, 0.0, 0.8)]
    middle = bench_cost.median_run(runs)
    assert middle["step_s"] == 2.0  # every exposed share ties: the sort kept run order
    assert middle["hidden_share"] == 0.8
    assert middle["exposed_share"] == 0.0


def test_each_measure_takes_its_own_median() -> None:
    bench_cost = load_bench_cost()
    runs = [run(1.0, 0.3, None), run(5.0, 0.1, 0.6), run(2.0, 0.2, 0.4)]
    middle = bench_cost.median_run(runs)
    assert (middle["step_s"], middle["exposed_share"], middle["hidden_share"]) == (2.0, 0.2, 0.5)
