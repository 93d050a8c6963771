"""Fibers (``ppswap.core.fiber``) and how a parking batch runs them: a body that gives the
thread up in the middle, is resumed once its wait is over, and whose composite partner
runs meanwhile (peers may run a composite's two leaves in the other order)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from ppswap.actors.batch import BatchOutcome, BatchRun, StepJob
from ppswap.core.arrival import Arrival
from ppswap.core.executor import Resume
from ppswap.core.fiber import Fiber, FiberAbandonedError, Suspended
from ppswap.scheduler.steps import MetaStep, StepKind


def _landed(label: str) -> Arrival:
    arrival = Arrival(label)
    arrival.land(label)
    return arrival


class _Body:
    """A job body run as a fiber that waits for ``wait`` once, then returns its label."""

    def __init__(self, label: str, wait: Arrival, log: list[str]) -> None:
        self.label, self.wait, self.log = label, wait, log
        self.fiber: Fiber | None = None

    def body(self) -> str:
        assert self.fiber is not None
        self.log.append(f"{self.label} starts")
        self.fiber.suspend(self.wait)
        self.log.append(f"{self.label} got {self.wait.wait(0.0)}")
        return self.label

    def __call__(self) -> Any:
        if self.fiber is None:
            self.fiber = Fiber(self.body, f"ppswap-test-{self.label}", timeout_s=10.0)
        return self.fiber.step()


def test_a_fiber_runs_in_steps_and_ends_its_thread() -> None:
    wait = Arrival("x")
    log: list[str] = []
    body = _Body("a", wait, log)
    first = body()
    assert isinstance(first, Suspended) and first.wait is wait
    assert log == ["a starts"]
    wait.land(7)
    assert body() == "a"
    assert log == ["a starts", "a got 7"]
    assert not [t for t in threading.enumerate() if t.name == "ppswap-test-a"]


def test_an_abandoned_fiber_raises_in_its_body_and_ends() -> None:
    seen: list[BaseException] = []
    holder: dict[str, Fiber] = {}

    def body() -> None:
        try:
            holder["f"].suspend(Arrival("never"))
        except FiberAbandonedError as exc:
            seen.append(exc)
            raise

    fiber = holder["f"] = Fiber(body, "ppswap-test-abandoned", timeout_s=10.0)
    assert isinstance(fiber.step(), Suspended)
    fiber.abandon()
    for thread in threading.enumerate():
        if thread.name == "ppswap-test-abandoned":
            thread.join(5.0)
    assert seen and "was abandoned while it waited for never" in str(seen[0])
    assert fiber.done


def test_a_fiber_error_is_raised_by_step() -> None:
    def body() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        Fiber(body, "ppswap-test-error").step()


def _resume(result: BatchOutcome | Resume) -> BatchOutcome | Resume:
    assert isinstance(result, Resume)
    return result.then()


def test_a_suspended_leaf_of_a_pair_lets_its_partner_run() -> None:
    """The two leaves of a composite both suspend in their exchanges; the batch parks on
    whichever comes first and finishes each once its exchange is over."""
    log: list[str] = []
    x, y = Arrival("x"), Arrival("y")
    first, second = _Body("fwd", x, log), _Body("bwd", y, log)
    jobs = [
        StepJob(MetaStep(StepKind.FWD, 0, 1), "forward", first, arrival=_landed("in-f")),
        StepJob(MetaStep(StepKind.BWD, 0, 0), "backward", second, arrival=_landed("in-b")),
    ]
    batch = BatchRun(jobs, None, None, 10.0, parks=True, pairs=frozenset({0}))
    parked = batch.run()
    assert isinstance(parked, Resume)
    assert log == ["fwd starts", "bwd starts"]  # the partner ran while fwd waited
    assert parked.after is not None and not parked.after.ready
    y.land("dy")
    assert parked.after.ready  # either exchange wakes the batch
    again = _resume(parked)
    assert isinstance(again, Resume) and again.after is x
    x.land("dx")
    outcome = _resume(again)
    assert isinstance(outcome, BatchOutcome) and outcome.error is None
    assert outcome.results == ["bwd", "fwd"] and list(outcome.order) == [1, 0]
    assert log == ["fwd starts", "bwd starts", "bwd got dy", "fwd got dx"]


def test_a_suspended_leaf_outside_a_pair_parks_the_batch() -> None:
    log: list[str] = []
    x = Arrival("x")
    body = _Body("fwd", x, log)
    after: Callable[[], str] = lambda: "after"  # noqa: E731
    jobs = [
        StepJob(MetaStep(StepKind.FWD, 0, 0), "forward", body),
        StepJob(MetaStep(StepKind.FWD, 1, 0), "forward", after),
    ]
    parked = BatchRun(jobs, None, None, 10.0, parks=True).run()
    assert isinstance(parked, Resume) and parked.after is x
    x.land(1)
    outcome = _resume(parked)
    assert isinstance(outcome, BatchOutcome) and outcome.results == ["fwd", "after"]


def test_a_blocking_batch_runs_the_partner_of_a_suspended_leaf() -> None:
    """A rank alone in its process (the batch blocks instead of parking): the same
    overlap, each exchange landed from another thread later."""
    log: list[str] = []
    x, y = Arrival("x"), Arrival("y")
    first, second = _Body("fwd", x, log), _Body("bwd", y, log)
    jobs = [
        StepJob(MetaStep(StepKind.FWD, 0, 1), "forward", first, arrival=_landed("in-f")),
        StepJob(MetaStep(StepKind.BWD, 0, 0), "backward", second, arrival=_landed("in-b")),
    ]

    def land_after(entry: str, arrival: Arrival, payload: str) -> None:
        # Each exchange lands once the batch got where it waits for it, however slowly
        # a loaded host runs the batch's thread (a landed arrival is not waited for).
        deadline = time.monotonic() + 10.0
        while entry not in log and time.monotonic() < deadline:
            time.sleep(0.005)
        arrival.land(payload)

    def lands() -> None:
        land_after("bwd starts", y, "dy")
        land_after("bwd got dy", x, "dx")

    lander = threading.Thread(target=lands, name="test-lander")
    lander.start()
    try:
        outcome = BatchRun(jobs, None, None, 10.0, parks=False, pairs=frozenset({0})).run()
    finally:
        lander.join()
    assert isinstance(outcome, BatchOutcome) and outcome.error is None
    assert outcome.results == ["bwd", "fwd"] and list(outcome.order) == [1, 0]
    assert log == ["fwd starts", "bwd starts", "bwd got dy", "fwd got dx"]


def test_a_blocking_batch_fails_at_the_deadline_of_a_suspended_leaf() -> None:
    body = _Body("fwd", Arrival("never"), [])
    jobs = [StepJob(MetaStep(StepKind.FWD, 0, 0), "forward", body)]
    outcome = BatchRun(jobs, None, None, 0.2, parks=False).run()
    assert isinstance(outcome, BatchOutcome)
    assert "never not there within 0.2s" in str(outcome.error)
    assert body.fiber is not None
    body.fiber.abandon()
