"""Fixtures of the swap tests: a real copy thread, a manager, an engine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from swap_support import CopyThread

from ppswap.swap import EmulatedDevice, PipelineSwapSession, SwapManager


@pytest.fixture
def copy_thread() -> Iterator[CopyThread]:
    thread = CopyThread()
    yield thread
    thread.close()


@pytest.fixture
def manager() -> SwapManager:
    return SwapManager()


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
