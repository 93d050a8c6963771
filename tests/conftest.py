"""Shared set-up: deterministic MindSpore context for every test, and the test lanes.

Lanes: ``make test-fast`` runs ``pytest -m "not slow"`` (the development lane); ``make
check`` runs everything, then ``make test-torch``: the torch backend's tests and the
framework-free ones in an environment without MindSpore and with NumPy 2, where a test
marked ``mindspore`` (it runs MindSpore, in process or in a script) is skipped. A test is
``slow`` when it is marked so itself or marked ``mpi`` or ``soak``; a suite that launches
processes (mpiexec, torchrun, the demo, the examples, a fresh interpreter) or searches many
configurations (hypothesis) says ``pytestmark = pytest.mark.slow`` at its top.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

try:  # a torch-only environment (the GPU machine) has no MindSpore
    import mindspore as ms
except ImportError:  # pragma: no cover - depends on the environment
    ms = None

SLOW_MARKERS = ("mpi", "soak")


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
        if any(item.get_closest_marker(m) for m in SLOW_MARKERS):
            item.add_marker(pytest.mark.slow)
        if ms is None and item.get_closest_marker("mindspore"):
            item.add_marker(no_mindspore)
