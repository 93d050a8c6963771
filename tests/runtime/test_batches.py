"""Compute-thread batches (``actors/batch.py``): announced jobs hand their result over at
once, a batch yields the thread before a compute leaf when other work waits, and a send's
payload is found among the batch's jobs."""

from __future__ import annotations

from typing import Any

from ppswap.actors.batch import StepJob, payload_maker, run_batch
from ppswap.scheduler.steps import MetaStep, StepKind


def _job(events: list[str], kind: str, step: MetaStep, *, announce: bool = False) -> StepJob:
    def body() -> str:
        events.append(f"run {step.short()}")
        return step.short()

    return StepJob(step, kind, body, announce=announce)


F0 = MetaStep(StepKind.FWD, 0, 0)
F1 = MetaStep(StepKind.FWD, 0, 1)
LAUNCH = MetaStep(StepKind.SWAP_LAUNCH_OFFLOAD, 0, 0)


def test_an_announced_result_is_handed_over_before_the_next_job_runs() -> None:
    events: list[str] = []

    def announce(index: int, result: Any) -> None:
        events.append(f"announce {index} {result}")

    jobs = [_job(events, "forward", F0, announce=True), _job(events, "forward", F1)]
    outcome = run_batch(jobs, announce)
    assert events == ["run F0.0", "announce 0 F0.0", "run F1.0"]
    assert outcome.results == ["F0.0", "F1.0"] and outcome.error is None


def test_the_last_job_of_a_batch_is_not_announced_its_result_is_in_the_outcome() -> None:
    events: list[str] = []

    def announce(index: int, result: Any) -> None:
        events.append(f"announce {index}")

    jobs = [_job(events, "forward", F0, announce=True), _job(events, "forward", F1, announce=True)]
    outcome = run_batch(jobs, announce)
    assert events == ["run F0.0", "announce 0", "run F1.0"]
    assert outcome.results == ["F0.0", "F1.0"]


def test_a_batch_yields_before_a_compute_leaf_when_other_work_waits() -> None:
    events: list[str] = []
    jobs = [
        _job(events, "forward", F0),
        _job(events, "swap_prepare", LAUNCH),  # a swap step does not yield
        _job(events, "forward", F1),
    ]
    outcome = run_batch(jobs, yield_to=lambda: True)
    assert events == ["run F0.0", "run LO0.0"]
    assert len(outcome.results) == 2 and outcome.error is None  # the rest is queued again
    events.clear()
    assert len(run_batch(jobs, yield_to=lambda: False).results) == 3


def test_a_failing_job_ends_the_batch_after_the_announced_ones() -> None:
    announced: list[int] = []

    def fails() -> None:
        raise ValueError("kernel failed")

    jobs = [
        _job([], "forward", F0, announce=True),
        StepJob(F1, "forward", fails),
        _job([], "forward", MetaStep(StepKind.FWD, 0, 2)),
    ]
    outcome = run_batch(jobs, lambda index, result: announced.append(index))
    assert announced == [0]
    assert len(outcome.results) == 1 and isinstance(outcome.error, ValueError)


def test_the_payload_of_a_send_is_made_by_its_forward_or_backward() -> None:
    events: list[str] = []
    backward_input = MetaStep(StepKind.BWD_INPUT, 1, 3)
    jobs = [_job(events, "forward", F0), _job(events, "backward_input", backward_input)]
    assert payload_maker(jobs, MetaStep(StepKind.SEND_F, 0, 0, peer=1)) == 0
    assert payload_maker(jobs, MetaStep(StepKind.SEND_B, 1, 3, peer=0)) == 1
    assert payload_maker(jobs, MetaStep(StepKind.SEND_F, 0, 1, peer=1)) is None
    assert payload_maker(jobs, MetaStep(StepKind.SEND_B, 0, 0, peer=1)) is None
