"""Shared set-up: deterministic MindSpore context for every test, and the test lanes.

Lanes (``--lane``): ``all``, the default, runs every test in this environment. ``make
check`` runs each test once, in the lane that gives it meaning: ``--lane torch`` (``make
test-torch``) collects only ``TORCH_LANE``'s paths, the torch backend's tests and the
framework-free ones, in an environment without MindSpore and with NumPy 2, where a test
marked ``mindspore`` (it runs MindSpore, in process or in a script) is skipped; ``--lane
main`` (``make test-main``) runs the rest, and of ``TORCH_LANE``'s tests those the torch
lane cannot run (marked ``mindspore``, or ``mpi``: that environment has no mpi4py). ``make
test`` runs every test in ``.venv``; ``make test-fast`` runs ``pytest -m "not slow"`` (the
development lane). A test is ``slow`` when it is marked so itself or marked ``mpi`` or
``soak``; a suite that launches processes (mpiexec, torchrun, the demo, the examples, a
fresh interpreter) or searches many configurations (hypothesis) says ``pytestmark =
pytest.mark.slow`` at its top.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

try:  # a torch-only environment (the GPU machine) has no MindSpore
    import mindspore as ms
except ImportError:  # pragma: no cover - depends on the environment
    ms = None

SLOW_MARKERS = ("mpi", "soak")

TESTS = Path(__file__).resolve().parent
# The torch lane's paths, relative to tests/: the torch backend's tests, the suites
# parametrized by backend or launcher (their MindSpore and MPI runs are marked), and the
# parts that need no tensor framework.
TORCH_LANE = (
    "across_processes",
    "both_backends",
    "torch_backend",
    "torch_dist",
    "scheduler",
    "docs",
    "runtime/test_demo.py",
    "runtime/test_examples.py",
)
# Marks of the tests in TORCH_LANE's paths that the torch lane cannot run.
NOT_IN_TORCH_LANE = ("mindspore", "mpi")
LANES = ("all", "main", "torch")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--lane",
        choices=LANES,
        default="all",
        help="all: every test; torch: TORCH_LANE's paths only (make test-torch); "
        "main: every test the torch lane does not run (make test-main)",
    )


def _in_torch_lane(path: Path) -> bool:
    return any(path.is_relative_to(TESTS / part) for part in TORCH_LANE)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The torch lane collects only TORCH_LANE's paths (and the folders above them)."""
    if config.getoption("lane") != "torch" or not collection_path.is_relative_to(TESTS):
        return None
    if _in_torch_lane(collection_path):
        return None
    above_lane = any((TESTS / part).is_relative_to(collection_path) for part in TORCH_LANE)
    return None if above_lane else True


@pytest.fixture(autouse=True, scope="session")
def _pynative() -> None:
    """PyNative on CPU, with synchronous dispatch from the first kernel on: MindSpore's
    dispatch threads keep slow hand-offs for the whole process once a kernel ran
    asynchronously (``ppswap/backends/mindspore/backend.py``), and tests run MindSpore
    ops outside ``run_schedule`` (whose ``run_scope`` would set it)."""
    if ms is not None:
        ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)


@pytest.fixture(autouse=True, scope="session")
def _frozen_imports() -> Iterator[None]:
    """Move what collection created (the frameworks' modules: 300,000 objects) out of the
    collector's reach: the leak checks that collect and scan every object
    (``reliability_support.live_swap_objects``) then take microseconds, not 150 ms."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_mindspore = pytest.mark.skip(reason="needs MindSpore, which this environment lacks")
    for item in items:
        if any(item.get_closest_marker(m) for m in SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)
        if ms is None and item.get_closest_marker("mindspore"):
            item.add_marker(no_mindspore)
    if config.getoption("lane") == "main":
        kept, in_torch_lane = [], []
        for item in items:
            torch_lane_runs_it = _in_torch_lane(item.path) and not any(
                item.get_closest_marker(m) for m in NOT_IN_TORCH_LANE
            )
            (in_torch_lane if torch_lane_runs_it else kept).append(item)
        config.hook.pytest_deselected(items=in_torch_lane)
        items[:] = kept
