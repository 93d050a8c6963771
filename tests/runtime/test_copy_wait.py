"""CopyWait: the compute thread waits for a running copy (a rank alone in its process)."""

from __future__ import annotations

import threading

import pytest

from ppswap.actors.copy_stream import CopyCompletion, CopyWait
from ppswap.core.arrival import ArrivalTimeoutError
from ppswap.errors import PipelineError


def test_a_wait_returns_when_the_copy_thread_sets_the_completion() -> None:
    completion = CopyCompletion("copy LO0.0 8B")
    wait = CopyWait(completion)
    setter = threading.Timer(0.05, completion.set)
    setter.start()
    wait.wait(5.0)
    setter.join()
    assert completion.is_set()


def test_a_failed_copy_raises_its_error_on_the_waiting_thread() -> None:
    completion = CopyCompletion("copy LO0.0 8B")
    completion.error = PipelineError("copy failed", rank=0, actor="copy", step="LO0.0")
    completion.set()
    with pytest.raises(PipelineError, match="copy failed"):
        CopyWait(completion).wait(1.0)


def test_a_wait_past_its_deadline_raises_and_abandon_frees_the_thread() -> None:
    completion = CopyCompletion("copy LL0.0 8B")
    wait = CopyWait(completion)
    with pytest.raises(ArrivalTimeoutError, match=r"LL0\.0"):
        wait.wait(0.01)
    wait.abandon("the run stopped")
    with pytest.raises(RuntimeError, match="the run stopped"):
        wait.wait(5.0)
    assert not completion.is_set()  # the copy itself is not marked done
