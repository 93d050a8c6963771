"""Deadlines of the hot path's waits (``core.deadlines``): a reply, a compute job and a
copy each give up at their deadline, are woken as soon as what they wait for happens,
and leave nothing armed or registered behind, also when cancelled."""

from __future__ import annotations

import asyncio
import threading
import time

import anyio
import pytest

from ppswap.actors.copy_stream import CopyCompletion
from ppswap.core.executor import DedicatedThread, JobDeadlineError
from ppswap.core.messages import FutureTimeoutError, ReplyFuture

pytestmark = pytest.mark.anyio

SHORT_S = 0.05


def _armed_timers() -> int:
    """Timers still scheduled on the running loop (cancelled ones excepted)."""
    loop = asyncio.get_running_loop()
    return sum(not timer.cancelled() for timer in loop._scheduled)  # type: ignore[attr-defined]


async def test_a_reply_not_resolved_in_time_raises_and_a_later_wait_gets_it() -> None:
    reply: ReplyFuture[int] = ReplyFuture("F0.s1")
    timers = _armed_timers()
    started = time.monotonic()
    with pytest.raises(FutureTimeoutError, match=r"F0.s1 not resolved within 0.05s"):
        await reply.wait(SHORT_S)
    assert SHORT_S <= time.monotonic() - started < 1.0
    assert _armed_timers() == timers
    reply.set_result(7)
    assert await reply.wait(SHORT_S) == 7


async def test_every_waiter_of_a_reply_is_woken_and_none_stays_registered() -> None:
    reply: ReplyFuture[str] = ReplyFuture("B3.s0")
    results: list[str] = []

    async def waiter() -> None:
        results.append(await reply.wait(10.0))

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(waiter)
        await anyio.sleep(0.01)
        timers = _armed_timers()
        assert timers >= 3
        reply.set_result("payload")
    assert results == ["payload"] * 3
    assert reply._waiters == []
    assert _armed_timers() <= timers - 3


async def test_a_cancelled_reply_wait_leaves_no_waiter_and_no_timer() -> None:
    reply: ReplyFuture[int] = ReplyFuture("F1.s2")
    timers = _armed_timers()
    with anyio.move_on_after(SHORT_S) as scope:
        await reply.wait(10.0)
    assert scope.cancelled_caught
    assert reply._waiters == []
    assert _armed_timers() == timers
    reply.set_result(1)  # resolving after a cancelled wait is fine
    assert reply.result() == 1


async def test_a_compute_job_past_its_deadline_raises_and_the_thread_goes_on() -> None:
    release = threading.Event()
    finished: list[str] = []

    def slow() -> None:
        assert release.wait(10)
        finished.append("slow")

    async with DedicatedThread("test-deadline") as thread:
        with pytest.raises(JobDeadlineError, match=r"job .*slow not finished within 0.05s"):
            await thread.run(slow, timeout_s=SHORT_S)
        release.set()
        assert await thread.run(lambda: "next", timeout_s=10.0) == "next"
    assert finished == ["slow"]  # the job ran to its end; only the wait gave up


async def test_a_compute_job_error_is_its_own_not_a_deadline() -> None:
    def fails() -> None:
        raise TimeoutError("the job's own timeout")

    async with DedicatedThread("test-deadline") as thread:
        with pytest.raises(TimeoutError, match="the job's own timeout") as caught:
            await thread.run(fails, timeout_s=10.0)
    assert not isinstance(caught.value, JobDeadlineError)


async def test_a_copy_completion_waits_until_set_or_its_deadline() -> None:
    completion = CopyCompletion("offload s1 m0")
    assert not await completion.wait_async(SHORT_S)

    def set_later() -> None:
        time.sleep(SHORT_S)
        completion.set()

    setter = threading.Thread(target=set_later)
    setter.start()
    started = time.monotonic()
    try:
        assert await completion.wait_async(10.0)
    finally:
        setter.join()
    assert time.monotonic() - started < 5.0
