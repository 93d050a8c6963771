"""Fixtures of the swap tests: a real copy thread, a manager, an engine; and a check that
every test leaves MindSpore's PyNative executor with no recorded forward pending."""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import mindspore as ms
import pytest
from swap_support import CopyThread, ForwardLedger

from ppswap.backends.mindspore import BACKEND as MINDSPORE
from ppswap.swap import EmulatedDevice, PipelineSwapSession, SwapManager

_CALL_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    if report.when == "call":
        item.stash[_CALL_FAILED] = report.failed
    return report


@pytest.fixture(autouse=True)
def forwards(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[ForwardLedger]:
    """Every swap test leaves MindSpore's PyNative executor with no forward recorded.

    A forward recorded by ``mindspore.vjp`` whose backward never runs stays in the
    executor, and two of them make a backward of a later test, here or in another
    directory (the runtime's), fail with "Can not find top cell for backward". So a test
    must run (``backward``) or release (``release_forward``) the backward of every forward
    it completed: one that does not fails here. A forward that raised inside ``ms.vjp`` has
    no backward to run; its open graph is discarded here. Either way the executor is
    cleaned up before the next test starts. (A test that failed already, and so may have
    stopped before its own clean-up, is not reported twice.)
    """
    ledger = ForwardLedger(ms.vjp)
    monkeypatch.setattr(ms, "vjp", ledger.vjp)
    yield ledger
    pending = ledger.pending
    if pending or ledger.raised:
        ledger.clean_up()
    if pending and not request.node.stash.get(_CALL_FAILED, False):
        pytest.fail(
            f"the test left {len(pending)} recorded forward(s) without a backward "
            f"({', '.join(pending)}): run backward(vjp_fn) or release_forward(vjp_fn)"
        )


@pytest.fixture
def copy_thread() -> Iterator[CopyThread]:
    thread = CopyThread()
    yield thread
    thread.close()


@pytest.fixture
def manager() -> SwapManager:
    return SwapManager(MINDSPORE)


@pytest.fixture
def engine() -> EmulatedDevice:
    return EmulatedDevice()


@pytest.fixture
def make_session(
    manager: SwapManager, engine: EmulatedDevice
) -> Iterator[Callable[..., PipelineSwapSession]]:
    """Build sessions on the shared manager/engine; abort any left open at teardown."""
    made: list[PipelineSwapSession] = []

    def make(eligible: Any = ((0, 0),), **kwargs: Any) -> PipelineSwapSession:
        options: dict[str, Any] = {"rank": 0, "generation": 1, "wait_timeout_s": 10.0}
        options.update(kwargs)
        session = PipelineSwapSession(
            options.pop("manager", manager),
            options.pop("engine", engine),
            eligible=eligible,
            **options,
        )
        made.append(session)
        return session

    yield make
    for session in made:
        session.abort()
