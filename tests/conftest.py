"""Shared set-up: deterministic MindSpore context for every test, and the test lanes.

Lanes: ``make test-fast`` runs ``pytest -m "not slow"`` (the development lane); ``make
check`` runs everything, then ``make test-torch``: the torch backend's tests and the
framework-free ones in an environment without MindSpore and with NumPy 2, where a test
marked ``mindspore`` (it runs MindSpore, in process or in a script) is skipped. A test is
``slow`` when it is marked so itself, when it is marked ``mpi`` or ``soak``, or when it
lives in one of ``SLOW_FILES``: suites that launch processes (mpiexec, torchrun, the demo,
the examples, a fresh interpreter) or search many configurations (hypothesis).
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
        "torch_backend/test_gpu_check.py",
    }
)


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


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    no_mindspore = pytest.mark.skip(reason="needs MindSpore, which this environment lacks")
    for item in items:
        relative = (
            item.path.relative_to(TESTS).as_posix() if item.path.is_relative_to(TESTS) else ""
        )
        if relative in SLOW_FILES or any(item.get_closest_marker(m) for m in SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)
        if ms is None and item.get_closest_marker("mindspore"):
            item.add_marker(no_mindspore)
