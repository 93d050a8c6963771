"""DedicatedThread: one pinned thread, FIFO per lane, the urgent lane served first."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from ppswap.core.executor import DedicatedThread, JobDeadlineError


async def _order_of_service() -> tuple[list[str], set[int]]:
    """Block the thread, queue normal and urgent jobs behind the blocker, release it."""
    served: list[str] = []
    idents: set[int] = set()
    release = threading.Event()
    started = threading.Event()

    def blocker() -> None:
        started.set()
        assert release.wait(10), "never released"

    def record(name: str) -> str:
        served.append(name)
        idents.add(threading.get_ident())
        return name

    async with DedicatedThread("test-compute") as thread, anyio.create_task_group() as tg:
        tg.start_soon(thread.run, blocker)
        await anyio.to_thread.run_sync(started.wait, 10)
        for name in ("leaf-a", "leaf-b"):
            tg.start_soon(thread.run, record, name)
            await anyio.sleep(0.01)  # queued in this order
        for name in ("swap-1", "swap-2"):
            tg.start_soon(thread.run_urgent, record, name)
            await anyio.sleep(0.01)
        release.set()
    return served, idents


def test_urgent_jobs_run_before_queued_normal_jobs_on_the_same_thread() -> None:
    served, idents = anyio.run(_order_of_service, backend="asyncio")
    # urgent first, each lane FIFO; every job on the one thread
    assert served == ["swap-1", "swap-2", "leaf-a", "leaf-b"]
    assert len(idents) == 1 and threading.get_ident() not in idents


def test_run_urgent_reraises_and_refuses_a_stopped_thread() -> None:
    def fail() -> None:
        raise ValueError("boom")

    async def main() -> DedicatedThread:
        async with DedicatedThread("test-compute") as thread:
            with pytest.raises(ValueError, match="boom"):
                await thread.run_urgent(fail)
            assert await thread.run_urgent(len, "abc") == 3
        return thread

    thread = anyio.run(main, backend="asyncio")

    async def after_stop() -> None:
        await thread.run_urgent(len, "abc")

    with pytest.raises(RuntimeError, match="not running"):
        anyio.run(after_stop, backend="asyncio")


def test_the_running_job_says_where_it_is_while_it_runs_and_nothing_after() -> None:
    async def main() -> tuple[str | None, str | None, str | None]:
        release, started = threading.Event(), threading.Event()
        where = ["at F0.1"]

        def stuck() -> None:
            started.set()
            assert release.wait(10), "never released"

        async with DedicatedThread("test-progress") as thread, anyio.create_task_group() as tg:
            tg.start_soon(lambda: thread.run(stuck, progress=lambda: where[0]))
            await anyio.to_thread.run_sync(started.wait, 10)
            first = thread.current_job
            where[0] = "at B0.1"
            second = thread.current_job
            release.set()
        return first, second, thread.current_job

    first, second, after = anyio.run(main)
    assert first is not None and first.startswith("test_the_running_job_says_where_it_is")
    assert "(at F0.1, for " in first and "(at B0.1, for " in (second or "")
    assert after is None


def test_a_job_that_reports_progress_is_timed_out_only_when_the_progress_stops() -> None:
    async def main() -> tuple[str, float]:
        moving = ["step 0"]
        release = threading.Event()

        def advancing() -> str:
            # 0.5 s in all, a new step every 10 ms: a loaded host would have to keep
            # this thread off the CPU for a whole 0.25 s window to stop its progress
            for n in range(1, 51):
                time.sleep(0.01)
                moving[0] = f"step {n}"
            return "done"

        def stuck() -> None:
            assert release.wait(10), "never released"

        async with DedicatedThread("test-progress-deadline") as thread:
            # 0.25 s without progress would be a missed deadline; it never comes.
            result = await thread.run(advancing, timeout_s=0.25, progress=lambda: moving[0])
            started = time.perf_counter()
            try:
                await thread.run(stuck, timeout_s=0.25, progress=lambda: "at F0.1")
            except JobDeadlineError:
                missed_after = time.perf_counter() - started
            finally:
                release.set()
        return result, missed_after

    result, missed_after = anyio.run(main)
    assert result == "done"
    assert 0.25 <= missed_after < 2.0  # one window without progress, not a renewal
