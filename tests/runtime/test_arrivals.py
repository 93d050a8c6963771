"""A compute thread that waits for its received payloads itself (``core.arrival``).

``Arrival`` on its own: landed once from any thread, waited for with a deadline,
abandoned. Then a rank alone in its process: ``PlayedPeer`` is a multi-process
``LandingTransport`` whose rank 0 is played by this test. It lands each payload from a
thread of its own, as ``TorchDistTransport`` does, or never; the rank under test is the
last stage of a two-stage MLP, so its forwards wait for activations that come from the
test. Every case checks that the run ends consistent: the compute thread is gone and
nothing started is left.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

from ppswap import PipelineError, PipelineHangError, PipelineStage, run_schedule
from ppswap.actors.batch import StepJob, after_arrival, run_batch
from ppswap.actors.copy_stream import CopyCompletion
from ppswap.actors.mail import RankMail
from ppswap.core.arrival import Arrival, ArrivalTimeoutError
from ppswap.core.messages import HostArray, MessageKey, ReplyFuture
from ppswap.core.transport import (
    FINISHED,
    RecvDone,
    SendDone,
    Started,
    TransportStats,
    is_landing,
    is_multi_process,
)
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.scheduler.steps import MetaStep, StepKind

DIM = 8
MICRO = 4
ROWS = 8


# -- Arrival ------------------------------------------------------------------------------


def test_a_payload_landed_on_another_thread_wakes_the_waiter_and_the_first_landing_wins() -> None:
    arrival = Arrival("F0.s1")
    payload = np.arange(4.0)
    lander = threading.Timer(0.05, lambda: arrival.land(payload))
    lander.start()
    started = time.perf_counter()
    assert arrival.wait(5.0) is payload
    assert 0.03 < time.perf_counter() - started < 2.0
    lander.join()
    assert arrival.landed
    assert not arrival.land(np.zeros(4))  # the later landing (the loop's) is ignored
    arrival.abandon("too late")
    assert arrival.wait(0.0) is payload


def test_waiting_past_the_deadline_raises_and_an_abandoned_arrival_raises_its_reason() -> None:
    arrival = Arrival("B3.s0")
    with pytest.raises(ArrivalTimeoutError, match=r"B3\.s0 not received within 0\.05s"):
        arrival.wait(0.05)
    abandoner = threading.Timer(0.05, arrival.abandon, args=("the run stopped",))
    abandoner.start()
    with pytest.raises(RuntimeError, match=r"B3\.s0: the run stopped"):
        arrival.wait(5.0)
    abandoner.join()


def test_resolving_a_reply_future_lands_its_arrival_with_the_result_or_the_error() -> None:
    ok = ReplyFuture[Any]("F1.s1", Arrival("F1.s1"))
    ok.set_result("payload")
    assert ok.arrival is not None and ok.arrival.wait(0.0) == "payload"
    failed = ReplyFuture[Any]("F2.s1", Arrival("F2.s1"))
    failed.fail(ConnectionError("link down"))
    assert failed.arrival is not None
    with pytest.raises(ConnectionError, match="link down"):
        failed.arrival.wait(0.0)


def test_a_batch_waits_for_a_jobs_arrival_outside_the_jobs_timing_and_stops_at_its_error() -> None:
    step = MetaStep(StepKind.FWD, 1, 0)
    arrival, doomed = Arrival("F0.s1"), Arrival("F1.s1")
    landing: list[float] = []

    def land() -> None:
        landing.append(time.perf_counter())
        arrival.land(np.float32(3))

    lander = threading.Timer(0.1, land)
    lander.start()
    jobs = [
        StepJob(step, "forward", lambda: "before"),
        StepJob(step, "forward", lambda: after_arrival(arrival, float), arrival=arrival),
        StepJob(step, "forward", lambda: "never", arrival=doomed),
    ]
    doomed.land(None, ConnectionError("peer gone"))
    outcome = run_batch(jobs, arrival_timeout_s=5.0)
    lander.join()
    assert outcome.results == ["before", 3.0]
    assert outcome.started[1] >= landing[0]  # the job's timing starts after the wait
    assert isinstance(outcome.error, ConnectionError)


class _Sink:
    def __init__(self) -> None:
        self.requests: list[Any] = []

    def send_nowait(self, request: Any) -> None:
        self.requests.append(request)


def test_the_mail_lists_receives_awaited_on_the_thread_until_they_resolve_and_no_longer() -> None:
    sink = _Sink()
    mail = RankMail(sink, lambda step, message: PipelineError(message), arrivals=True)  # type: ignore[arg-type]
    steps = [MetaStep(StepKind.RECV_F, 1, micro, peer=0) for micro in range(3)]
    for step in steps:
        mail.post(step)
    payloads = []
    for step, request in zip(steps, sink.requests, strict=True):
        arrival = mail.take_arrival(request.key, step)
        assert arrival is request.reply.arrival is not None
        assert f"recv {request.reply.label} (awaited on the compute thread)" in mail.pending()
        payloads.append(payload := np.zeros(2))
        request.reply.set_result(payload)
        assert arrival.landed
    assert mail.pending() == [] and mail.leftovers() is None
    # Once the transport and the leaf dropped a receive, its payload is gone: the mail
    # keeps none for the rest of the run, with no further take to prune it.
    freed = [weakref.ref(payload) for payload in payloads]
    del payloads, payload, arrival, request
    sink.requests.clear()
    assert [ref() for ref in freed] == [None, None, None]


def test_the_lists_of_what_the_thread_waits_for_are_pruned_as_they_grow() -> None:
    mail = RankMail(_Sink(), lambda step, message: PipelineError(message), arrivals=True)  # type: ignore[arg-type]
    completions = [CopyCompletion(f"copy {n}") for n in range(1000)]
    for completion in completions:
        mail.copy_on_thread(completion)
        completion.set_value(None)  # done at once: pruned at the next doubling
    assert len(mail.copies_on_thread) < 16
    assert mail.pending() == []


# -- a rank alone in its process ---------------------------------------------------------


class _Receive:
    def __init__(self, peer: PlayedPeer, key: MessageKey, on_done: RecvDone) -> None:
        self.peer, self.key, self.on_done = peer, key, on_done

    def cancel(self) -> None:
        if self.peer.live.pop(self.key, None) is not None:
            self.peer.cancelled += 1


class PlayedPeer:
    """Rank 1 of 2; the test plays rank 0 (module docstring). ``payloads``: what each
    receive lands with, from a thread ``delay_s`` after it was started; a key missing
    never lands; ``fail``: receives that fail on the loop instead; ``refuse``: sends whose
    start raises."""

    rank = 1
    world_size = 2
    starts_messages = True

    def __init__(
        self,
        payloads: dict[MessageKey, HostArray],
        *,
        delay_s: float = 0.02,
        fail: frozenset[MessageKey] = frozenset(),
        refuse: frozenset[MessageKey] = frozenset(),
    ) -> None:
        self.payloads, self.delay_s, self.fail, self.refuse = payloads, delay_s, fail, refuse
        self.live: dict[MessageKey, _Receive] = {}
        self.sent: dict[MessageKey, HostArray] = {}
        self.landed_on_thread = 0
        self.cancelled = 0
        self.threads: list[threading.Thread] = []

    def start_send(
        self, src: int, dst: int, key: MessageKey, payload: HostArray, on_done: SendDone
    ) -> Started:
        if key in self.refuse:
            raise ConnectionError(f"send {key} refused")
        self.sent[key] = payload.copy()
        on_done(None)
        return FINISHED

    def start_recv(self, dst: int, src: int, key: MessageKey, on_done: RecvDone) -> Started:
        raise AssertionError("a receive the compute thread may wait for lands on a thread")

    def start_recv_landing(
        self,
        dst: int,
        src: int,
        key: MessageKey,
        on_done: RecvDone,
        on_landed: Callable[[HostArray], object],
    ) -> Started:
        receive = self.live[key] = _Receive(self, key, on_done)
        loop = asyncio.get_running_loop()
        if key in self.fail:
            loop.call_later(self.delay_s, self._done, key, None, ConnectionError("link down"))
        elif key in self.payloads:
            thread = threading.Thread(target=self._land, args=(loop, key, on_landed))
            self.threads.append(thread)
            thread.start()
        return receive

    def _land(
        self,
        loop: asyncio.AbstractEventLoop,
        key: MessageKey,
        on_landed: Callable[[HostArray], object],
    ) -> None:
        time.sleep(self.delay_s)
        payload = self.payloads[key].copy()
        on_landed(payload)
        self.landed_on_thread += 1
        loop.call_soon_threadsafe(self._done, key, payload, None)

    def _done(self, key: MessageKey, payload: HostArray | None, error: Exception | None) -> None:
        receive = self.live.pop(key, None)
        if receive is not None:  # not cancelled
            receive.on_done(payload, error)

    async def send(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None:
        raise AssertionError("the P2P actor starts messages on this transport")

    async def recv(self, dst: int, src: int, key: MessageKey) -> HostArray:
        raise AssertionError("the P2P actor starts messages on this transport")

    def stats(self) -> TransportStats:
        return TransportStats(len(self.sent), self.landed_on_thread, 0, len(self.live))

    def join(self) -> None:
        for thread in self.threads:
            thread.join(5.0)


def _activations() -> dict[MessageKey, HostArray]:
    rng = np.random.default_rng(11)
    rows = ROWS // MICRO
    return {
        MessageKey("F", 1, micro): rng.standard_normal((rows, DIM)).astype(np.float32)
        for micro in range(MICRO)
    }


async def _run_last_stage(peer: PlayedPeer, **options: Any) -> Any:
    module = build_mlp_stages(2, dim=DIM)[1]
    stage = PipelineStage(module, 1, 2)
    rng = np.random.default_rng(5)
    x, y = (rng.standard_normal((ROWS, DIM)).astype(np.float32) for _ in range(2))
    kwargs: dict[str, Any] = {"micro_batch_num": MICRO, "loss_fn": mse_loss, "step_timeout": 30.0}
    kwargs |= {"schedule": "gpipe"} | options
    result = await run_schedule([stage], inputs=x, targets=y, transport=peer, **kwargs)
    return result, stage


def _compute_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "ppswap-compute"]


def test_the_played_peer_is_a_landing_multi_process_transport() -> None:
    peer = PlayedPeer({})
    assert is_landing(peer) and is_multi_process(peer)


@pytest.mark.asyncio
async def test_the_forwards_wait_for_their_payloads_on_the_thread_in_one_batch() -> None:
    payloads = _activations()
    waited = PlayedPeer(payloads, delay_s=0.05)
    result, stage = await _run_last_stage(waited)
    waited.join()
    grads = [g.asnumpy() for g in stage.grads]
    # The same payloads, there before the forwards ask: nothing to wait for.
    ready = PlayedPeer(payloads, delay_s=0.0)
    ready_result, ready_stage = await _run_last_stage(ready)
    ready.join()
    assert waited.landed_on_thread == MICRO
    (rank,) = result.ranks
    assert rank.compute_batches == 1  # 4 forwards waited on the thread, then 4 backwards
    assert result.losses == ready_result.losses
    for got, want in zip(grads, [g.asnumpy() for g in ready_stage.grads], strict=True):
        np.testing.assert_array_equal(got, want)
    assert sorted(waited.sent) == [MessageKey("B", 0, m) for m in range(MICRO)]
    assert waited.live == {} and _compute_threads() == []


@pytest.mark.asyncio
async def test_cancelling_the_run_frees_a_compute_thread_waiting_for_a_payload() -> None:
    peer = PlayedPeer({})  # nothing ever lands
    started = time.perf_counter()
    with anyio.move_on_after(0.3) as scope:
        await _run_last_stage(peer, step_timeout=60.0)
    assert scope.cancelled_caught
    assert time.perf_counter() - started < 5.0  # not the 60 s deadline
    assert _compute_threads() == []
    assert peer.live == {} and peer.cancelled == MICRO


@pytest.mark.asyncio
async def test_a_payload_that_never_comes_misses_the_deadline_on_the_compute_thread() -> None:
    peer = PlayedPeer({})
    started = time.perf_counter()
    with pytest.raises(PipelineHangError) as caught:
        await _run_last_stage(peer, step_timeout=0.3)
    assert time.perf_counter() - started < 5.0
    error = caught.value
    assert (error.rank, error.actor, error.step) == (1, "compute", "F0.1")
    assert "F0.s1 not received within 0.3s" in str(error)
    assert "recv F3.s1 (awaited on the compute thread)" in str(error.dump)
    assert _compute_threads() == []
    assert peer.live == {}


@pytest.mark.asyncio
async def test_a_failed_receive_wakes_the_waiting_compute_thread_with_the_p2p_failure() -> None:
    payloads = _activations()
    del payloads[MessageKey("F", 1, 2)]
    peer = PlayedPeer(payloads, fail=frozenset({MessageKey("F", 1, 2)}))
    started = time.perf_counter()
    with pytest.raises(PipelineError) as caught:
        await _run_last_stage(peer, step_timeout=60.0)
    peer.join()
    assert time.perf_counter() - started < 5.0
    assert caught.value.actor == "p2p"
    assert "recv F2->s1 from rank 0 failed" in str(caught.value)
    assert _compute_threads() == []
    assert peer.live == {}


@pytest.mark.asyncio
async def test_a_send_that_fails_ends_the_run_without_waiting_for_what_comes_after_it() -> None:
    # B1 cannot be sent; the compute thread must not then wait for F2 and F3 (the same
    # batch), which the peer would only send after B1 (here they never come).
    payloads = {k: v for k, v in _activations().items() if k.micro < 2}
    peer = PlayedPeer(payloads, refuse=frozenset({MessageKey("B", 0, 1)}))
    started = time.perf_counter()
    with pytest.raises(PipelineError) as caught:
        await _run_last_stage(peer, schedule="1f1b", step_timeout=60.0)
    peer.join()
    assert time.perf_counter() - started < 5.0
    error = caught.value
    assert (error.rank, error.actor) == (1, "p2p")
    assert "send B1->s0 to rank 0 failed: ConnectionError" in str(error)
    assert sorted(peer.sent) == [MessageKey("B", 0, 0)]
    assert _compute_threads() == []
    assert peer.live == {}
