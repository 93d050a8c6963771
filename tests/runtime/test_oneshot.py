"""OneShot: set once by the first of several threads; waiters and callbacks see that value."""

from __future__ import annotations

import threading
import time

import pytest

from ppswap.core.oneshot import OneShot


def test_the_first_set_wins_and_later_ones_change_nothing() -> None:
    shot: OneShot[str] = OneShot()
    assert not shot.is_set()
    with pytest.raises(RuntimeError, match="before the value was set"):
        _ = shot.value
    assert shot.set_value("first") is True
    assert shot.set_value("second") is False
    assert shot.is_set() and shot.value == "first"
    assert shot.wait(0.0) is True


def test_callbacks_run_once_on_the_setting_thread_or_at_once_when_already_set() -> None:
    shot: OneShot[int] = OneShot()
    calls: list[tuple[str, int]] = []
    shot.on_set(lambda: calls.append((threading.current_thread().name, shot.value)))
    setter = threading.Thread(target=shot.set_value, args=(7,), name="setter")
    setter.start()
    setter.join(timeout=5.0)
    assert calls == [("setter", 7)]
    shot.set_value(8)  # no second run
    shot.on_set(lambda: calls.append((threading.current_thread().name, shot.value)))
    assert calls == [("setter", 7), (threading.current_thread().name, 7)]


def test_wait_times_out_then_wakes_when_another_thread_sets() -> None:
    shot: OneShot[None] = OneShot()
    started = time.perf_counter()
    assert shot.wait(0.05) is False
    assert time.perf_counter() - started >= 0.05
    timer = threading.Timer(0.05, shot.set_value, args=(None,))
    timer.start()
    assert shot.wait(5.0) is True
    timer.join(timeout=5.0)


def _race(setters: int) -> tuple[list[int], list[int], int]:
    """``setters`` threads set one OneShot at once: who won, what the callback saw, the value."""
    shot: OneShot[int] = OneShot()
    seen: list[int] = []
    shot.on_set(lambda: seen.append(shot.value))
    barrier = threading.Barrier(setters)
    won: list[int] = []

    def race(n: int) -> None:
        barrier.wait(timeout=5.0)
        if shot.set_value(n):
            won.append(n)

    threads = [threading.Thread(target=race, args=(n,)) for n in range(setters)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=5.0)
    return won, seen, shot.value


def test_racing_setters_leave_one_value_and_one_run_of_each_callback() -> None:
    for _ in range(50):
        won, seen, value = _race(8)
        assert len(won) == 1 and seen == won and value == won[0]


def test_every_blocked_waiter_wakes_and_a_timed_out_one_is_withdrawn() -> None:
    shot: OneShot[int] = OneShot()
    assert shot.wait(0.01) is False  # timed out before anyone set it
    assert shot._waiters == []  # withdrawn: set_value will not release a lock nobody holds
    woken: list[bool] = []
    waiters = [threading.Thread(target=lambda: woken.append(shot.wait(5.0))) for _ in range(4)]
    unbounded = threading.Thread(target=lambda: woken.append(shot.wait(float("inf"))))
    for thread in [*waiters, unbounded]:
        thread.start()
    deadline = time.perf_counter() + 5.0
    while len(shot._waiters) < 5 and time.perf_counter() < deadline:
        time.sleep(0.001)
    assert len(shot._waiters) == 5  # all five blocked
    assert shot.set_value(3) is True
    for thread in [*waiters, unbounded]:
        thread.join(timeout=5.0)
    assert woken == [True] * 5 and shot._waiters == []
    assert shot.wait(0.0) is True and shot.wait(-1.0) is True
