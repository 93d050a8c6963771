"""The P2P actor: serves one rank's sends, receives and collectives through a Transport.

``P2PActor`` serves the requests the compute actor posts and resolves each request's
reply future with the result or the error. A send or receive it serves without a task
is handed to it as it is posted (``P2PChannel.send_nowait``, on the compute actor's
task: no hop through the channel); everything else goes through the channel, which the
actor drains without a loop iteration per request. How a request is served depends on
the transport (``ppswap/core/transport.py`` has the protocols):

- ``ImmediateTransport`` (``InProcessTransport``, every rank in this event loop): a send
  is delivered and a receive registered on the spot; the future is resolved when the
  payload is there.
- ``CallbackTransport`` (``MPITransport``, ``TorchDistTransport``: one process per rank):
  the send or receive is started (``start_send`` / ``start_recv``) and the transport
  calls back on the loop when it completes; the actor keeps the started operations and
  their handles, and resolves the future in the callback. No task, no cancel scope, no
  await per message. A receive whose future has an ``Arrival`` (a compute thread waits
  for it itself) is started with ``start_recv_landing`` where the transport is a
  ``LandingTransport``, so the payload reaches that thread from the transport's. Once the
  channel closes the actor waits for the operations still
  started, with the step deadline (a missed one is a ``PipelineHangError``); when it
  ends otherwise (failure, cancellation) it cancels them, so no callback reaches a run
  that is over.
- Otherwise, with a fault plan, and for collectives: each request is served by its own
  task in the actor's task group (``await transport.send/recv``, a span on the P2P lane),
  so a receive waiting for a slow peer never holds up a send or another receive. A
  ``FaultPlan`` (tests) can fail, delay or drop (sends only) a message before it reaches
  the transport there.

Whichever way, a send and a receive never wait for each other (a rank's receive must not
wait for its own earlier send: ``docs/mpi.md``), and a failed send or receive resolves
its reply future with the same ``PipelineError`` the actor raises (naming this rank,
``p2p`` and the step), so the run reports the P2P failure, not the compute step that
waited for it.

Collectives (FSDP): ``CollectiveTransport`` is the transport's collective side
(``all_gather(rank, group, key, array)``, ``reduce_scatter_sum(rank, group, key,
arrays)``; ``rank`` is the caller, as ``send``'s ``src``), a separate protocol so that a
P2P-only transport still satisfies ``Transport``; a run with FSDP requires it, and
expert parallelism ``AllToAllTransport`` (both refused before the run, ``fsdp.plan``). A
``CollectiveRequest`` gets its own task and a span named ``"{op} {key}"``.

``InProcessTransport`` lives in ``ppswap.transports.inprocess`` and is exported here too.
"""

from __future__ import annotations

import asyncio
import math

import anyio
import structlog
from anyio.streams.memory import (
    MemoryObjectReceiveStream,
    MemoryObjectSendStream,
    MemoryObjectStreamStatistics,
)

from ppswap.actors.trace import FlightRecorder
from ppswap.core.deadlines import resolve, wait_woken
from ppswap.core.faults import FaultAction, FaultPlan, FaultSite
from ppswap.core.messages import (
    CollectiveRequest,
    HostArray,
    P2PRequest,
    RecvRequest,
    SendRequest,
)
from ppswap.core.transport import (
    CallbackTransport,
    CollectiveTransport,
    ImmediateTransport,
    LandingTransport,
    PointToPoint,
    Started,
    is_all_to_all,
    is_callback,
    is_immediate,
    is_landing,
)
from ppswap.errors import PipelineError, PipelineHangError, named_failure
from ppswap.logs import log_step
from ppswap.scheduler.steps import MetaStep
from ppswap.transports.inprocess import InProcessTransport

__all__ = ["InProcessTransport", "P2PActor", "P2PChannel", "p2p_channel"]


class _Started:
    """A send or receive started on a ``CallbackTransport``, until it calls back."""

    __slots__ = ("actor", "handle", "request", "started_us")

    def __init__(self, actor: P2PActor, request: SendRequest | RecvRequest, started_us: float):
        self.actor = actor
        self.request = request
        self.started_us = started_us
        self.handle: Started | None = None

    def sent(self, error: BaseException | None) -> None:
        self.actor._ended(self, None, error)

    def received(self, payload: HostArray | None, error: BaseException | None) -> None:
        self.actor._ended(self, payload, error)


class P2PChannel:
    """The compute actor's end of its channel to the P2P actor (``p2p_channel``).

    A send or receive the actor serves without a task (an immediate or a callback
    transport, no fault plan) is handed to the actor as it is posted (``send_nowait``),
    on the poster's task: no hop through the channel and no wake-up of the actor per
    message. Anything else (collectives, the task path) and everything once the actor
    has stopped taking requests is queued on the channel. Closing it (``close``, or
    leaving ``async with``) closes the channel: the actor drains it and ends.
    """

    def __init__(self, sender: MemoryObjectSendStream[P2PRequest]) -> None:
        self._sender = sender
        self._closed = False
        self.actor: P2PActor | None = None

    def send_nowait(self, item: P2PRequest) -> None:
        actor = self.actor
        if actor is None or self._closed or not actor.take(item):
            self._sender.send_nowait(item)

    async def send(self, item: P2PRequest) -> None:
        actor = self.actor
        if actor is None or self._closed or not actor.take(item):
            await self._sender.send(item)

    def statistics(self) -> MemoryObjectStreamStatistics:
        return self._sender.statistics()

    def close(self) -> None:
        self._closed = True
        self._sender.close()

    async def __aenter__(self) -> P2PChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()


def p2p_channel(
    capacity: int,
) -> tuple[P2PChannel, MemoryObjectReceiveStream[P2PRequest]]:
    """A compute -> P2P channel holding ``capacity`` requests; ``P2PChannel.actor`` is set
    once the actor is made."""
    sender, receiver = anyio.create_memory_object_stream[P2PRequest](capacity)
    return P2PChannel(sender), receiver


class P2PActor:
    """Serves one rank's SendRequest / RecvRequest / CollectiveRequest messages through a
    Transport (see the module docstring)."""

    actor_name = "p2p"

    def __init__(
        self,
        rank: int,
        transport: PointToPoint,
        requests: MemoryObjectReceiveStream[P2PRequest],
        recorder: FlightRecorder,
        *,
        timeout_s: float = math.inf,
        collectives: CollectiveTransport | None = None,
        generation: int = 0,
        log_steps: bool = False,
        faults: FaultPlan | None = None,
    ) -> None:
        self.rank = rank
        self._faults = faults
        self._generation = generation
        self._log_steps = log_steps
        self._log = structlog.get_logger("ppswap").bind(rank=rank, actor=self.actor_name)
        self._transport = transport
        self._requests = requests
        self._recorder = recorder
        self._timeout_s = timeout_s
        self._collectives = collectives
        self._pending: dict[int, str] = {}  # the task path's requests in flight
        self._started: dict[_Started, None] = {}  # the callback path's, in start order
        self._failure: tuple[PipelineError, BaseException] | None = None
        self._scope: anyio.CancelScope | None = None
        self._idle: asyncio.Future[None] | None = None  # resolved when _started empties
        self._taking = True  # until run() ends: take() serves sends and receives
        self._immediate: ImmediateTransport | None = None
        self._callbacks: CallbackTransport | None = None
        self._landing: LandingTransport | None = None
        if faults is None:
            if is_immediate(transport):
                self._immediate = transport
            elif is_callback(transport) and transport.starts_messages:
                self._callbacks = transport
            if self._callbacks is not None and is_landing(transport):
                self._landing = transport
        recorder.register_pending(rank, self.actor_name, self._pending_items)

    def _pending_items(self) -> list[str]:
        items = sorted(self._pending.values())
        items += [f"{_label(op.request)} (started)" for op in self._started]
        return items

    def take(self, request: P2PRequest) -> bool:
        """Serve a send or receive right away, without a task (an immediate or callback
        transport, no fault plan): True if it was taken, False if it must go through the
        channel (a collective, the task path, or the actor's run is over). Once the actor
        failed, a request taken gets its failure."""
        if not self._taking or isinstance(request, CollectiveRequest):
            return False
        if self._immediate is None and self._callbacks is None:
            return False
        if self._failure is not None:
            request.reply.fail(self._failure[0])
        elif self._callbacks is not None:
            self._start(self._callbacks, request)
        else:
            assert self._immediate is not None
            try:
                self._serve_now(self._immediate, request)
            except Exception as exc:
                self._fail(request, exc)
        return True

    async def run(self) -> None:
        """Serve requests until the request channel closes, then wait for those in flight
        (with the deadline, those started on a callback transport)."""
        try:
            with anyio.CancelScope() as self._scope:
                await self._serve_all()
                if self._started and self._failure is None:
                    await self._drain()
        finally:
            self._taking = False
            self._scope = None
            self.cancel_started()
        if self._failure is not None:
            error, cause = self._failure
            if error is cause:
                raise error
            raise error from cause

    async def _serve_all(self) -> None:
        async with anyio.create_task_group() as tg, self._requests:
            while self._failure is None:
                try:
                    request = self._requests.receive_nowait()
                except anyio.WouldBlock:
                    try:
                        request = await self._requests.receive()
                    except anyio.EndOfStream:
                        return
                except anyio.EndOfStream:
                    return
                if not self.take(request):
                    tg.start_soon(self._serve, request)

    def _serve_now(self, transport: ImmediateTransport, request: SendRequest | RecvRequest) -> None:
        """A send delivered, or a receive registered, on the spot (module docstring)."""
        recorder = self._recorder
        recorder.note(self.rank, self.actor_name, request.step)
        if isinstance(request, SendRequest):
            transport.deliver(self.rank, request.dst, request.key, request.payload)
            request.reply.set_result(None)
            if recorder.keeps_spans:
                recorder.add_span(self.rank, self.actor_name, _label(request), recorder.now_us())
        elif recorder.keeps_spans:
            started = recorder.now_us()

            def arrived(payload: HostArray) -> None:
                request.reply.set_result(payload)
                recorder.add_span(self.rank, self.actor_name, _label(request), started)

            transport.expect(self.rank, request.src, request.key, arrived)
        else:
            transport.expect(self.rank, request.src, request.key, request.reply.set_result)
        if self._log_steps:
            self._log_message(request)

    # -- the callback path ----------------------------------------------------------------
    def _start(self, transport: CallbackTransport, request: SendRequest | RecvRequest) -> None:
        """Start a send or receive; ``_ended`` resolves its future (module docstring)."""
        recorder = self._recorder
        recorder.note(self.rank, self.actor_name, request.step)
        op = _Started(self, request, recorder.now_us() if recorder.keeps_spans else 0.0)
        self._started[op] = None
        try:
            if isinstance(request, SendRequest):
                handle = transport.start_send(
                    self.rank, request.dst, request.key, request.payload, op.sent
                )
            elif (arrival := request.reply.arrival) is not None and self._landing is not None:
                handle = self._landing.start_recv_landing(
                    self.rank, request.src, request.key, op.received, arrival.land
                )
            else:
                handle = transport.start_recv(self.rank, request.src, request.key, op.received)
        except Exception as exc:  # nothing was started
            del self._started[op]
            self._fail(request, exc)
            return
        if op in self._started:  # it did not end at once
            op.handle = handle

    def _ended(self, op: _Started, payload: HostArray | None, error: BaseException | None) -> None:
        """The transport's callback: resolve the request's future (or fail it, and the actor)."""
        if op not in self._started:  # cancelled: no longer ours
            return
        del self._started[op]
        request = op.request
        if error is None:
            if isinstance(request, SendRequest):
                request.reply.set_result(None)
            else:
                request.reply.set_result(payload)
            if self._recorder.keeps_spans:
                self._recorder.add_span(self.rank, self.actor_name, _label(request), op.started_us)
            if self._log_steps:
                self._log_message(request)
        else:
            self._fail(request, error)
        if not self._started and self._idle is not None:
            resolve(self._idle)

    def _fail(self, request: SendRequest | RecvRequest, error: BaseException) -> None:
        """Resolve the request's future with its failure, named; the actor raises the
        first one (``run``)."""
        label = _label(request)
        self._recorder.note(self.rank, self.actor_name, "FAILED", f"{label}:", type(error).__name__)
        failure = self._named(error, label, request.step)
        request.reply.fail(failure)
        if self._failure is None:
            self._failure = (failure, error)
            if self._scope is not None:
                self._scope.cancel()  # run() raises it

    async def _drain(self) -> None:
        """After the channel closed: wait for the started operations, with the deadline."""
        self._idle = asyncio.get_running_loop().create_future()
        try:
            await wait_woken(self._idle, self._timeout_s)
        finally:
            self._idle = None
        if self._started and self._failure is None:
            request = next(iter(self._started)).request
            raise PipelineHangError(
                f"{_label(request)} not done within {self._timeout_s}s "
                f"({len(self._started)} started operations)",
                rank=self.rank,
                actor=self.actor_name,
                step=request.step.short(),
                dump=self._recorder.dump(),
            )

    def cancel_started(self) -> None:
        """Cancel what is still started (failure, cancellation, a missed deadline; the
        runtime's teardown calls it too, for an actor whose run never began)."""
        ops, self._started = list(self._started), {}
        for op in ops:
            if op.handle is not None:
                op.handle.cancel()

    # -- the task path ----------------------------------------------------------------------
    async def _serve(self, request: P2PRequest) -> None:
        if isinstance(request, CollectiveRequest):
            await self._serve_collective(request)
            return
        step = request.step
        label = _label(request)
        self._pending[id(request)] = label
        try:
            with self._recorder.span(self.rank, self.actor_name, label, step=step.short()):
                deliver = True
                if self._faults is not None:
                    deliver = await self._inject(self._faults, step)
                if isinstance(request, SendRequest):
                    if deliver:
                        await self._transport.send(
                            self.rank, request.dst, request.key, request.payload
                        )
                    request.reply.set_result(None)
                else:
                    payload = await self._transport.recv(self.rank, request.src, request.key)
                    request.reply.set_result(payload)
            if self._log_steps:
                self._log_message(request)
        except Exception as exc:
            error = self._named(exc, label, step)
            request.reply.fail(error)
            raise error from exc
        finally:
            self._pending.pop(id(request), None)

    def _log_message(self, request: SendRequest | RecvRequest) -> None:
        """The structured log event of a send or receive that completed."""
        event = "send" if isinstance(request, SendRequest) else "recv"
        log_step(self._log, event, request.step, self._generation, peer=request.step.peer)

    def _named(self, error: BaseException, label: str, step: MetaStep) -> PipelineError:
        message = f"{label} failed: {error!r}"
        return named_failure(
            error, message, rank=self.rank, actor=self.actor_name, step=step.short()
        )

    async def _inject(self, faults: FaultPlan, step: MetaStep) -> bool:
        """Apply the plan's P2P rule for ``step``; False when the message is dropped."""
        rule = faults.match(FaultSite.P2P, self.rank, step)
        if rule is None:
            return True
        self._recorder.note(self.rank, self.actor_name, rule.describe(self.rank, step))
        if rule.action is FaultAction.DELAY:
            await anyio.sleep(rule.delay_s)
        elif rule.action is FaultAction.DROP:
            return False
        else:
            rule.raise_fault(self.rank, step)
        return True

    async def _serve_collective(self, request: CollectiveRequest) -> None:
        label = f"{request.op} {request.key}"
        self._pending[id(request)] = f"{label} over ranks {request.group}"
        try:
            with self._recorder.span(
                self.rank,
                self.actor_name,
                label,
                step=request.step.short(),
                group=list(request.group),
            ):
                collectives = self._collectives
                if collectives is None:
                    raise RuntimeError("this run's transport has no collectives")
                if request.op == "all_gather":
                    (array,) = request.payload
                    gathered = await collectives.all_gather(
                        self.rank, request.group, request.key, array
                    )
                    request.reply.set_result(tuple(gathered))
                elif request.op == "all_to_all":
                    if not is_all_to_all(collectives):
                        raise RuntimeError("this run's transport has no all_to_all")
                    received = await collectives.all_to_all(
                        self.rank, request.group, request.key, list(request.payload)
                    )
                    request.reply.set_result(tuple(received))
                else:
                    total = await collectives.reduce_scatter_sum(
                        self.rank, request.group, request.key, list(request.payload)
                    )
                    request.reply.set_result((total,))
        except Exception as exc:
            error = self._named(exc, label, request.step)
            request.reply.fail(error)
            raise error from exc
        finally:
            self._pending.pop(id(request), None)


def _label(request: SendRequest | RecvRequest) -> str:
    """``send F2->s1 to rank 1`` / ``recv F2->s1 from rank 0`` (spans, dumps)."""
    key = request.key
    if isinstance(request, SendRequest):
        return f"send {key.direction}{key.micro}->s{key.stage} to rank {request.dst}"
    return f"recv {key.direction}{key.micro}->s{key.stage} from rank {request.src}"
