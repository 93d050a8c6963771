"""Shared set-up: deterministic MindSpore context for every test, and the test lanes.

Lanes: ``make test-fast`` runs ``pytest -m "not slow"`` (the development lane); ``make
check`` runs everything. A test is ``slow`` when it is marked so itself, when it is marked
``mpi`` or ``soak``, or when it lives in one of ``SLOW_FILES``: suites that launch
processes (mpiexec, torchrun, the demo, the examples, a fresh interpreter) or search many
configurations (hypothesis).
"""

from __future__ import annotations

from pathlib import Path

import pytest

try:  # a torch-only environment (the GPU machine) has no MindSpore
    import mindspore as ms
except ImportError:  # pragma: no cover - depends on the environment
    ms = None

TESTS = Path(__file__).parent
SLOW_MARKERS = ("mpi", "soak")
SLOW_FILES = frozenset(
    {
        "mpi/test_mpi_runtime.py",
        "mpi/test_mpi_transport.py",
        "reliability/test_async_service.py",
        "reliability/test_cancellation.py",
        "reliability/test_fuzz.py",
        "reliability/test_soak.py",
        "runtime/test_demo.py",
        "runtime/test_examples.py",
        "fsdp/test_fsdp_demo.py",
        "cost/test_cost_planner.py",
    }
)


@pytest.fixture(autouse=True, scope="session")
def _pynative() -> None:
    if ms is not None:
        ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        relative = (
            item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        )
        if relative in SLOW_FILES or any(item.get_closest_marker(m) for m in SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)
