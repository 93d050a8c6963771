"""Ranks that share the compute thread: batches park on their arrivals instead of blocking.

``DedicatedThread``'s ``Resume`` (park until ready, yield, a parked job's deadline),
``ThreadHandoff`` (a payload handed over on the thread, whichever side comes first),
``start_batch`` (a batch that parks, and one that times out parked), and a whole
in-process run: every rank's order runs as one batch, and its losses and gradients are
the ones of a run whose ranks wait on the event loop (a fault plan that never fires
turns the batches off).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import anyio
import numpy as np
import pytest

from ppswap import PipelineStage, run_schedule
from ppswap.actors.batch import BatchOutcome, BatchRun, StepJob, after_arrival, start_batch
from ppswap.actors.handoff import ThreadHandoff
from ppswap.core.arrival import Arrival, ArrivalTimeoutError, FirstOf
from ppswap.core.executor import DedicatedThread, Resume
from ppswap.core.faults import FaultPlan, fail_compute
from ppswap.core.messages import MessageKey
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.scheduler.steps import MetaStep, StepKind
from ppswap.swap import swap_wrapper

pytestmark = pytest.mark.anyio

KEY = MessageKey("F", 1, 0)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_parked_job_lets_the_thread_serve_others_and_resumes_when_ready() -> None:
    arrival = Arrival("F0.s1")
    served: list[str] = []

    def consumer() -> Resume:
        served.append("consumer parks")
        return Resume(lambda: (served.append("consumer resumed"), arrival.wait(0.0))[1], arrival)

    def producer() -> str:
        served.append("producer")
        arrival.land("payload")  # on the thread itself, as a handoff does
        return "made"

    async with DedicatedThread("test-park") as thread:
        results: dict[str, Any] = {}

        async def call(name: str, fn: Any) -> None:
            results[name] = await thread.run(fn, timeout_s=10)

        async with anyio.create_task_group() as tg:
            tg.start_soon(call, "consumer", consumer)
            with anyio.fail_after(10):  # the thread took the consumer, which parks
                while "consumer parks" not in served:
                    await anyio.sleep(0.005)
            assert not thread.has_waiting()  # a parked job is not waiting: the thread is free
            tg.start_soon(call, "producer", producer)
    assert results == {"consumer": "payload", "producer": "made"}
    assert served == ["consumer parks", "producer", "consumer resumed"]


async def test_a_yield_goes_on_behind_the_jobs_queued() -> None:
    served: list[str] = []
    gate = threading.Event()

    def long_batch() -> Resume:
        served.append("batch part 1")
        assert gate.wait(10)
        return Resume(lambda: served.append("batch part 2") or "done")

    async with DedicatedThread("test-yield") as thread, anyio.create_task_group() as tg:
        tg.start_soon(thread.run, long_batch)
        await anyio.sleep(0.05)
        tg.start_soon(thread.run, served.append, "other rank")
        await anyio.sleep(0.05)
        gate.set()
    assert served == ["batch part 1", "other rank", "batch part 2"]


async def test_a_parked_job_past_its_deadline_runs_and_reports_it() -> None:
    never = Arrival("F0.s1")

    def parks() -> Resume:
        def then() -> str:
            return "landed" if never.ready else "timed out"

        return Resume(then, never, deadline_s=0.1)

    async with DedicatedThread("test-deadline") as thread:
        with anyio.fail_after(5):
            assert await thread.run(parks) == "timed out"


def test_the_handoff_lands_the_arrival_whichever_side_comes_first() -> None:
    handoff = ThreadHandoff()
    payload = np.arange(3.0)
    early = Arrival("expected first")
    handoff.expect(1, 0, KEY, early)
    handoff.put(0, 1, KEY, payload)
    assert early.wait(0.0) is payload
    late = Arrival("put first")
    handoff.put(0, 1, MessageKey("F", 1, 1), payload)
    handoff.expect(1, 0, MessageKey("F", 1, 1), late)
    assert late.wait(0.0) is payload
    assert len(handoff) == 0


def test_an_expectation_landed_another_way_is_forgotten() -> None:
    handoff = ThreadHandoff()
    arrival = Arrival("via the loop")
    handoff.expect(1, 0, KEY, arrival)
    assert len(handoff) == 1
    arrival.land("delivered by the P2P actor")
    assert len(handoff) == 0  # nothing is held for a message already received


def _job(step: MetaStep, run: Any, arrival: Arrival | None = None) -> StepJob:
    return StepJob(step, "forward", run, arrival=arrival)


def test_a_batch_parks_at_an_arrival_and_its_outcome_covers_every_job() -> None:
    arrival = Arrival("F1.s1")
    jobs = [
        _job(MetaStep(StepKind.FWD, 1, 0), lambda: "first"),
        _job(MetaStep(StepKind.FWD, 1, 1), lambda: after_arrival(arrival, str.upper), arrival),
    ]
    first = start_batch(jobs, arrival_timeout_s=5.0)
    assert isinstance(first, Resume) and first.after is arrival
    arrival.land("second")
    outcome = first.then()
    assert isinstance(outcome, BatchOutcome) and outcome.error is None
    assert outcome.results == ["first", "SECOND"]
    assert outcome.waited[1] > 0.0


def test_a_batch_resumed_past_its_deadline_fails_at_the_waiting_job() -> None:
    arrival = Arrival("F1.s1")
    jobs = [_job(MetaStep(StepKind.FWD, 1, 1), lambda: after_arrival(arrival, str), arrival)]
    parked = start_batch(jobs, arrival_timeout_s=0.5)
    assert isinstance(parked, Resume)
    outcome = parked.then()  # what the thread does once the deadline passed
    assert isinstance(outcome, BatchOutcome)
    assert isinstance(outcome.error, ArrivalTimeoutError)
    assert "F1.s1 not there within 0.5s" in str(outcome.error)
    assert outcome.results == []


def test_first_of_two_waits_is_ready_with_either_and_calls_back_once() -> None:
    first, second = Arrival("B0.s1"), Arrival("F2.s1")
    either = FirstOf(first, second)
    called: list[str] = []
    either.on_ready(lambda: called.append("ready"))
    assert not either.ready and either.label == "B0.s1 or F2.s1"
    second.land("grad")
    first.land("activation")
    assert either.ready and called == ["ready"]  # once, though both landed
    lost = FirstOf(Arrival("a"), Arrival("b"))
    lost.abandon("stopped")
    with pytest.raises(RuntimeError, match="stopped"):
        lost.first.wait(0.0)
    with pytest.raises(RuntimeError, match="stopped"):
        lost.second.wait(0.0)


def _pair() -> tuple[list[StepJob], Arrival, Arrival]:
    """A composite's two leaves, both waiting for their inputs (a ``BatchRun`` pair)."""
    grad, activation = Arrival("B0.s0"), Arrival("F2.s0")
    jobs = [
        _job(MetaStep(StepKind.BWD, 0, 0), lambda: after_arrival(grad, str.upper), grad),
        _job(MetaStep(StepKind.FWD, 0, 2), lambda: after_arrival(activation, str), activation),
    ]
    return jobs, grad, activation


def test_a_parked_pair_runs_the_leaf_whose_input_came_first() -> None:
    jobs, grad, activation = _pair()
    parked = BatchRun(jobs, None, None, 5.0, parks=True, pairs=frozenset({0})).run()
    assert isinstance(parked, Resume) and isinstance(parked.after, FirstOf)
    assert not parked.after.ready
    activation.land("f2")  # the forward's input first: it runs first
    assert parked.after.ready
    outcome = parked.then()
    assert isinstance(outcome, Resume)  # parked again, now on the backward's own input
    assert outcome.after is grad
    grad.land("b0")
    done = outcome.then()
    assert isinstance(done, BatchOutcome) and done.error is None
    assert done.results == ["f2", "B0"] and list(done.order) == [1, 0]


@pytest.mark.parametrize("forward_first", [True, False])
def test_a_blocking_pair_runs_the_leaf_whose_input_came_first(forward_first: bool) -> None:
    jobs, grad, activation = _pair()
    first, second = (activation, "f2"), (grad, "b0")
    if not forward_first:
        first, second = second, first
    # The second input lands only once the leaf of the first has run (its hand-off), so
    # the order the batch sees does not hang on how soon its thread wakes.
    ran_first = threading.Event()
    index = 1 if forward_first else 0
    jobs[index] = dataclasses.replace(jobs[index], hand_offs=(lambda _: ran_first.set(),))

    def land_in_order() -> None:
        time.sleep(0.05)  # mostly the batch waits for both by then (either way: first)
        first[0].land(first[1])
        ran_first.wait(10)
        second[0].land(second[1])

    lander = threading.Thread(target=land_in_order)
    lander.start()
    outcome = BatchRun(jobs, None, None, 5.0, parks=False, pairs=frozenset({0})).run()
    lander.join()
    assert isinstance(outcome, BatchOutcome) and outcome.error is None
    if forward_first:
        assert outcome.results == ["f2", "B0"] and list(outcome.order) == [1, 0]
    else:
        assert outcome.results == ["B0", "f2"] and list(outcome.order) == [0, 1]


def test_a_blocking_pair_whose_inputs_never_come_fails_at_its_deadline() -> None:
    jobs, _, _ = _pair()
    outcome = BatchRun(jobs, None, None, 0.1, parks=False, pairs=frozenset({0})).run()
    assert isinstance(outcome, BatchOutcome)
    assert isinstance(outcome.error, ArrivalTimeoutError)
    assert "neither B0.s0 nor F2.s0 within 0.1s" in str(outcome.error)
    assert outcome.results == []


def _run(
    schedule: str, faults: FaultPlan | None, **options: Any
) -> tuple[list[float], list[Any], list[int]]:
    modules = build_mlp_stages(4, dim=8, seed=3, wrap=swap_wrapper)
    stages = [PipelineStage(module, i, 4) for i, module in enumerate(modules)]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.standard_normal((16, 8)).astype(np.float32)

    async def main() -> Any:
        return await run_schedule(
            stages,
            schedule=schedule,
            micro_batch_num=8,
            pp=2 if schedule == "interleaved_1f1b" else 4,
            swap=True,
            inputs=x,
            targets=y,
            loss_fn=mse_loss,
            faults=faults,
            step_timeout=30.0,  # a wait nobody ends fails the test in seconds, not minutes
            **options,
        )

    result = anyio.run(main)
    grads = [g.asnumpy() for stage in stages for g in stage.grads]
    return result.losses, grads, [r.compute_batches for r in result.ranks]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_in_process_ranks_run_their_orders_as_parked_batches_bit_identically(
    schedule: str,
) -> None:
    losses, grads, batches = _run(schedule, None)
    # A rule that never matches wraps the same path: the same numbers, the same batches.
    never = FaultPlan((fail_compute(StepKind.FWD, rank=99),))
    step_losses, step_grads, step_batches = _run(schedule, never)
    assert step_batches == batches
    assert losses == step_losses
    for grad, step_grad in zip(grads, step_grads, strict=True):
        np.testing.assert_array_equal(grad, step_grad)
    # Nothing in these orders ends a batch (receives are posted, sends ride along, a
    # SWAP_WAIT_* waits for the copy its own batch launched): one batch per rank.
    assert batches == [1] * len(batches)


@pytest.mark.parametrize(
    ("schedule", "options"),
    [
        ("1f1b", {"overlap_b_f": True}),
        ("1f1b", {"p2p": "batch"}),
        ("interleaved_1f1b", {"split_dw": True, "overlap_b_f": True}),
    ],
)
def test_composites_and_batched_p2p_of_parked_ranks_take_their_inputs_on_the_thread(
    schedule: str, options: dict[str, Any]
) -> None:
    # Parked ranks post their sends only with their batches' outcomes, and a composite's
    # leaf (overlap_b_f) takes its input on the thread too; these orders have the steps
    # that may end a batch (a composite whose two inputs both still wait, BATCH_SEND_RECV)
    # between the parked ones.
    losses, grads, batches = _run(schedule, None, **options)
    never = FaultPlan((fail_compute(StepKind.FWD, rank=99),))
    step_losses, step_grads, step_batches = _run(schedule, never, **options)
    assert losses == step_losses
    for grad, step_grad in zip(grads, step_grads, strict=True):
        np.testing.assert_array_equal(grad, step_grad)
    assert batches == step_batches  # a fault plan wraps the path, never selects another
    if options.get("overlap_b_f"):
        # A composite joins the batch as its two leaves, whichever of them waits for its
        # input (before: it ended a batch, and its leaves took one each).
        assert batches == [1] * len(batches)
