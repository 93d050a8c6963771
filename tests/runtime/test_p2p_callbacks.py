"""The P2P actor's path without a task per message: a ``CallbackTransport``.

``LoopCallbackTransport`` keeps every rank in this event loop but offers only what the
multi-process transports offer the actor: ``start_send`` / ``start_recv`` with a callback
on the loop (never before ``start_*`` returns, as a message in flight completes) and
handles to cancel; its awaitable ``send`` / ``recv`` count their calls, so a test can tell
which path the actor took. ``live`` holds what was started and has neither called back
nor been cancelled: after any run, failed, timed out or cancelled, it must be empty.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

from ppswap import PipelineError, PipelineHangError, PipelineStage, StepKind, run_schedule
from ppswap.actors.p2p import InProcessTransport, P2PActor, p2p_channel
from ppswap.actors.trace import FlightRecorder
from ppswap.core.faults import FaultPlan, delay_message
from ppswap.core.messages import HostArray, MessageKey, RecvRequest, ReplyFuture, SendRequest
from ppswap.core.transport import (
    CallbackTransport,
    ImmediateTransport,
    RecvDone,
    SendDone,
    Started,
    TransportStats,
    call_back,
    complete_all,
    is_callback,
)
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.scheduler.steps import MetaStep
from ppswap.swap import swap_wrapper

DIM = 8
Box = tuple[int, int, MessageKey]


class _Op:
    """One started operation of ``LoopCallbackTransport``."""

    def __init__(self, transport: LoopCallbackTransport, on_done: Callable[..., None]) -> None:
        self.transport = transport
        self.on_done = on_done
        transport.live.add(self)

    def complete(self, *result: Any) -> None:
        """Call back from the loop, later (unless cancelled by then)."""
        asyncio.get_running_loop().call_soon(self._call, result)

    def _call(self, result: tuple[Any, ...]) -> None:
        if self in self.transport.live:
            self.transport.live.discard(self)
            self.on_done(*result)

    def cancel(self) -> None:
        if self in self.transport.live:
            self.transport.live.discard(self)
            self.transport.cancelled += 1


class LoopCallbackTransport(InProcessTransport):
    """Every rank in this loop, through the ``CallbackTransport`` protocol (module doc).

    An ``InProcessTransport`` (so a run takes every stage in this process) that is not an
    ``ImmediateTransport``: a protocol method set to None is one the class does not have.
    ``fail``: receives (by ``(dst, key)``) that call back with an error; ``refuse``: sends
    (by ``(src, key)``) whose ``start_send`` raises; ``never``: receives that never call
    back.
    """

    starts_messages = True
    deliver = None  # type: ignore[assignment]
    expect = None  # type: ignore[assignment]

    def __init__(
        self,
        *,
        fail: frozenset[tuple[int, MessageKey]] = frozenset(),
        refuse: frozenset[tuple[int, MessageKey]] = frozenset(),
        never: frozenset[tuple[int, MessageKey]] = frozenset(),
    ) -> None:
        super().__init__()
        self.fail, self.refuse, self.never = fail, refuse, never
        self.boxes: dict[Box, HostArray] = {}
        self.waiting: dict[Box, _Op] = {}
        self.live: set[_Op] = set()
        self.started = 0
        self.cancelled = 0
        self.awaited = 0

    def start_send(
        self, src: int, dst: int, key: MessageKey, payload: HostArray, on_done: SendDone
    ) -> Started:
        if (src, key) in self.refuse:
            raise RuntimeError(f"send {key} refused")
        self.started += 1
        assert isinstance(payload, np.ndarray)  # host payloads across "processes"
        receiver = self.waiting.pop((src, dst, key), None)
        if receiver is not None:
            receiver.complete(payload.copy(), None)
        else:
            self.boxes[(src, dst, key)] = payload.copy()
        op = _Op(self, on_done)
        op.complete(None)
        return op

    def start_recv(self, dst: int, src: int, key: MessageKey, on_done: RecvDone) -> Started:
        self.started += 1
        op = _Op(self, on_done)
        if (dst, key) in self.fail:
            op.complete(None, RuntimeError(f"link to rank {src} down"))
        elif (dst, key) in self.never:
            pass
        elif (src, dst, key) in self.boxes:
            op.complete(self.boxes.pop((src, dst, key)), None)
        else:
            self.waiting[(src, dst, key)] = op
        return op

    async def send(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None:
        self.awaited += 1
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.start_send(src, dst, key, payload, lambda error: future.set_result(None))
        await future

    async def recv(self, dst: int, src: int, key: MessageKey) -> HostArray:
        self.awaited += 1
        future: asyncio.Future[HostArray] = asyncio.get_running_loop().create_future()

        def done(payload: HostArray | None, error: BaseException | None) -> None:
            if error is not None:
                future.set_exception(error)
            else:
                assert payload is not None
                future.set_result(payload)

        handle = self.start_recv(dst, src, key, done)
        try:
            return await future
        finally:
            handle.cancel()

    def stats(self) -> TransportStats:
        return TransportStats(self.started, 0, 0, len(self.live))

    def reset(self) -> None:
        """After a failed or cancelled run (the runtime calls it): drop what is parked."""
        super().reset()
        self.boxes.clear()
        self.waiting.clear()


def _stages(stage_num: int = 2) -> list[PipelineStage]:
    modules = build_mlp_stages(stage_num, dim=DIM, wrap=swap_wrapper)
    return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]


def _data() -> tuple[HostArray, HostArray]:
    rng = np.random.default_rng(5)
    return tuple(rng.standard_normal((8, DIM)).astype(np.float32) for _ in range(2))  # type: ignore[return-value]


async def _run(stages: list[PipelineStage], transport: Any, **options: Any) -> Any:
    x, y = _data()
    kwargs: dict[str, Any] = {"micro_batch_num": 4, "loss_fn": mse_loss, "swap": True}
    kwargs |= {"step_timeout": 30.0} | options
    return await run_schedule(stages, "gpipe", inputs=x, targets=y, transport=transport, **kwargs)


def _grads(stages: list[PipelineStage]) -> list[HostArray]:
    return [g.asnumpy() for stage in stages for g in stage.grads]


def test_the_fake_is_a_callback_transport_and_not_an_immediate_one() -> None:
    transport = LoopCallbackTransport()
    assert isinstance(transport, CallbackTransport) and is_callback(transport)
    assert not isinstance(transport, ImmediateTransport)


@pytest.mark.asyncio
async def test_messages_are_started_not_awaited_and_equal_the_in_process_run() -> None:
    expected_stages = _stages()
    expected = await _run(expected_stages, InProcessTransport())
    stages = _stages()
    transport = LoopCallbackTransport()
    for _ in range(2):  # the same stages and transport again: nothing of the first run left
        result = await _run(stages, transport)
        assert result.losses == expected.losses
        for want, got in zip(_grads(expected_stages), _grads(stages), strict=True):
            np.testing.assert_array_equal(want, got)
    # GPipe pp2 m4: 4 activations and 4 gradients, each a send and a receive, per run
    assert transport.started == 2 * 16
    assert transport.awaited == 0 and transport.cancelled == 0
    assert not transport.live and not transport.waiting and not transport.boxes


@pytest.mark.asyncio
async def test_a_failed_receive_resolves_its_future_and_ends_the_run_naming_p2p() -> None:
    stages = _stages()
    transport = LoopCallbackTransport(fail=frozenset({(1, MessageKey("F", 1, 2))}))
    with pytest.raises(PipelineError) as caught:
        await _run(stages, transport)
    error = caught.value
    assert (error.rank, error.actor, error.step) == (1, "p2p", "RF2.1")
    assert "[rank 1, actor p2p, step RF2.1] recv F2->s1 from rank 0 failed" in str(error)
    assert isinstance(error.__cause__, RuntimeError)
    assert "link to rank 0 down" in str(error.__cause__)
    assert not transport.live  # what was still started is cancelled
    # the same stages run again over a transport that works
    expected_stages = _stages()
    expected = await _run(expected_stages, InProcessTransport())
    assert (await _run(stages, LoopCallbackTransport())).losses == expected.losses


@pytest.mark.asyncio
async def test_a_send_the_transport_refuses_fails_with_its_step() -> None:
    transport = LoopCallbackTransport(refuse=frozenset({(0, MessageKey("F", 1, 1))}))
    with pytest.raises(PipelineError) as caught:
        await _run(_stages(), transport)
    error = caught.value
    assert (error.rank, error.actor, error.step) == (0, "p2p", "SF1.0")
    assert "send F1->s1 to rank 1 failed" in str(error)
    assert "refused" in str(error.__cause__)
    assert not transport.live


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_a_receive_that_never_completes_ends_at_the_deadline_leaving_nothing() -> None:
    transport = LoopCallbackTransport(never=frozenset({(1, MessageKey("F", 1, 2))}))
    timeout = 1.0
    started = time.perf_counter()
    with pytest.raises(PipelineHangError) as caught:
        await _run(_stages(), transport, step_timeout=timeout)
    elapsed = time.perf_counter() - started
    assert timeout <= elapsed < timeout + 10
    error = caught.value
    # rank 1's forward waits for the payload, rank 0's first backward for its gradient
    assert error.actor == "compute"
    assert (error.rank, error.step) in {(1, "F2.1"), (0, "B0.0")}
    assert "recv F2->s1 from rank 0 (started)" in error.dump  # the P2P actor's pending list
    assert not transport.live and transport.cancelled >= 1


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_the_actor_waits_for_started_operations_with_its_deadline() -> None:
    """Once its channel closes, the actor waits for what it started, with the deadline."""
    transport = LoopCallbackTransport(never=frozenset({(1, MessageKey("B", 1, 0))}))
    channel, requests = p2p_channel(4)
    recorder = FlightRecorder()
    actor = P2PActor(1, transport, requests, recorder, timeout_s=0.3)
    channel.actor = actor
    step = MetaStep(StepKind.RECV_B, 1, 0, peer=2)
    reply: ReplyFuture[Any] = ReplyFuture("B0.s1")
    channel.send_nowait(RecvRequest(step, MessageKey("B", 1, 0), 2, reply))
    sent: ReplyFuture[None] = ReplyFuture("F0.s2")
    send_step = MetaStep(StepKind.SEND_F, 1, 0, peer=2)
    channel.send_nowait(SendRequest(send_step, MessageKey("F", 2, 0), 2, np.ones(3), sent))
    assert transport.started == 2  # both started as they were posted, before run()
    channel.close()
    started = time.perf_counter()
    with pytest.raises(PipelineHangError) as caught:
        await actor.run()
    assert 0.3 <= time.perf_counter() - started < 5
    error = caught.value
    assert (error.rank, error.actor, error.step) == (1, "p2p", "RB0.1")
    assert "recv B0->s1 from rank 2 not done within 0.3s" in str(error)
    assert sent.done and sent.result() is None and not reply.done
    assert not transport.live and transport.cancelled == 1


@pytest.mark.asyncio
async def test_a_request_posted_after_a_failure_gets_that_failure() -> None:
    transport = LoopCallbackTransport(fail=frozenset({(0, MessageKey("B", 0, 0))}))
    channel, requests = p2p_channel(4)
    actor = P2PActor(0, transport, requests, FlightRecorder(), timeout_s=5)
    channel.actor = actor
    first: ReplyFuture[Any] = ReplyFuture("B0.s0")
    step = MetaStep(StepKind.RECV_B, 0, 0, peer=1)
    channel.send_nowait(RecvRequest(step, MessageKey("B", 0, 0), 1, first))
    with pytest.raises(PipelineError) as caught:
        with anyio.fail_after(5):
            await actor.run()
    assert (caught.value.actor, caught.value.step) == ("p2p", "RB0.0")
    with pytest.raises(PipelineError) as waited:
        first.result()
    assert waited.value is caught.value
    later: ReplyFuture[Any] = ReplyFuture("B1.s0")
    later_step = MetaStep(StepKind.RECV_B, 0, 1, peer=1)
    with pytest.raises(anyio.BrokenResourceError):  # the actor is gone: the channel says so
        channel.send_nowait(RecvRequest(later_step, MessageKey("B", 0, 1), 1, later))
    channel.close()
    assert not transport.live


@pytest.mark.timeout(60)
@pytest.mark.asyncio
async def test_cancelling_the_run_cancels_what_was_started() -> None:
    transport = LoopCallbackTransport(never=frozenset({(1, MessageKey("F", 1, 3))}))
    stages = _stages()
    with anyio.move_on_after(1.0) as scope:
        await _run(stages, transport, step_timeout=60.0)
    assert scope.cancelled_caught
    assert not transport.live and transport.cancelled >= 1
    expected = await _run(_stages(), InProcessTransport())
    assert (await _run(stages, LoopCallbackTransport())).losses == expected.losses


@pytest.mark.asyncio
async def test_a_fault_plan_takes_the_task_path() -> None:
    transport = LoopCallbackTransport()
    plan = FaultPlan((delay_message(0.01, StepKind.SEND_F, rank=0, stage=0, micro=1),))
    result = await _run(_stages(), transport, faults=plan)
    expected = await _run(_stages(), InProcessTransport())
    assert result.losses == expected.losses
    assert transport.awaited == 16  # every send and receive awaited in its own task
    assert not transport.live


@pytest.mark.asyncio
async def test_complete_all_raises_the_first_failure_and_cancels_the_rest() -> None:
    transport = LoopCallbackTransport(
        fail=frozenset({(0, MessageKey("F", 0, 1))}), never=frozenset({(0, MessageKey("F", 0, 2))})
    )

    def recv(micro: int) -> Callable[[Callable[..., None]], Started]:
        return lambda done: transport.start_recv(0, 1, MessageKey("F", 0, micro), done)

    with pytest.raises(RuntimeError, match="link to rank 1 down"):
        await complete_all([recv(2), recv(1)])
    assert not transport.live and transport.cancelled == 1


@pytest.mark.asyncio
async def test_a_callback_that_raises_is_reported_and_the_others_still_run() -> None:
    reported: list[BaseException] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: reported.append(context["exception"]))
    try:
        calls: list[str] = []

        def broken(error: BaseException | None) -> None:
            raise ValueError("broken callback")

        for on_done in (broken, lambda error: calls.append("second")):
            call_back(on_done, None)
    finally:
        loop.set_exception_handler(None)
    assert calls == ["second"]
    assert len(reported) == 1 and "broken callback" in str(reported[0])
