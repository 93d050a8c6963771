"""The P2P actor and the Transport it talks through.

``P2PActor`` serves the sends and receives of one rank. Each request is served by its own
task in the actor's task group, so a receive waiting for a slow peer never holds up a send
or another receive; the result (or the error) resolves the request's reply future. A
transport that can match a message at once (``ImmediateTransport``: the in-process one)
is served without a task: a send is delivered and a receive registered on the spot, its
future resolved when the payload is there (not with a fault plan: faults take the task
path, where they can wait). The actor drains its channel without a loop iteration per
request.

``Transport`` is the seam to the outside world: ``InProcessTransport`` (every rank in this
process and event loop, the embedded default) and ``MPITransport`` (``ppswap.actors.mpi``:
one process per rank over mpi4py). Payloads are host numpy arrays; a message is identified
by ``(src, dst, MessageKey)``, which is unique within a run.

Collectives (FSDP): ``CollectiveTransport`` is the Transport's collective side, with the
signatures of ``MPITransport`` (``all_gather(rank, group, key, array)``,
``reduce_scatter_sum(rank, group, key, arrays)``; ``rank`` is the caller, as ``send``'s
``src``). It is a separate protocol so that a P2P-only transport still satisfies
``Transport``; a run with FSDP requires it. ``InProcessTransport`` implements it with a
rendezvous per call. The P2P actor serves a ``CollectiveRequest`` like a send or a
receive: its own task, a span named ``"{op} {key}"`` on the P2P lane, the result (or
error) on the request's reply future.

A failed send or receive resolves its reply future with the same ``PipelineError`` the
actor raises (naming this rank, ``p2p`` and the step), so the run reports the P2P
failure, not the compute step that waited for it. A ``FaultPlan`` (tests) can fail,
delay or drop (sends only) a message before it reaches the transport.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import numpy as np
import structlog
from anyio.streams.memory import MemoryObjectReceiveStream

from ppswap.actors.trace import FlightRecorder
from ppswap.core.faults import FaultAction, FaultPlan, FaultSite
from ppswap.core.messages import (
    CollectiveRequest,
    HostArray,
    MessageKey,
    P2PRequest,
    RecvRequest,
    SendRequest,
)
from ppswap.core.transport import (
    CollectiveTransport,
    ImmediateTransport,
    Transport,
    TransportStats,
)
from ppswap.errors import PipelineError, named_failure
from ppswap.logs import log_step
from ppswap.scheduler.steps import MetaStep

__all__ = ["InProcessTransport", "P2PActor"]


@dataclass(slots=True)
class _Rendezvous:
    group: tuple[int, ...]
    contributions: dict[int, tuple[HostArray, ...]] = field(default_factory=dict)
    complete: anyio.Event = field(default_factory=anyio.Event)
    taken: int = 0


@dataclass(slots=True)
class _Mailbox:
    payload: HostArray | None = None
    arrived: bool = False
    on_arrival: Callable[[HostArray], None] | None = None
    waiter: anyio.Event | None = None


class InProcessTransport:
    """All ranks in one process and one event loop: a mailbox per message.

    A send never blocks (the payload is parked in the mailbox until its receiver takes
    it), which is the buffered-send semantics the schedule validator assumes. Both the
    awaitable ``send``/``recv`` and the immediate ``deliver``/``expect`` are served.
    """

    def __init__(self) -> None:
        self._mailboxes: dict[tuple[int, int, MessageKey], _Mailbox] = {}
        self._rendezvous: dict[tuple[str, tuple[int, ...], str, int], _Rendezvous] = {}
        self._collective_calls: dict[tuple[str, tuple[int, ...], str, int], int] = {}
        self._sent = 0
        self._received = 0
        self._bytes_sent = 0

    def _box(self, src: int, dst: int, key: MessageKey) -> _Mailbox:
        box = self._mailboxes.get((src, dst, key))
        if box is None:
            box = self._mailboxes[(src, dst, key)] = _Mailbox()
        return box

    def deliver(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None:
        box = self._box(src, dst, key)
        if box.arrived:
            raise RuntimeError(f"message {key} from rank {src} to rank {dst} sent twice")
        self._sent += 1
        self._bytes_sent += payload.nbytes
        if box.on_arrival is not None:
            del self._mailboxes[(src, dst, key)]
            self._received += 1
            box.on_arrival(payload)
            return
        box.payload, box.arrived = payload, True
        if box.waiter is not None:
            box.waiter.set()

    def expect(
        self, dst: int, src: int, key: MessageKey, on_arrival: Callable[[HostArray], None]
    ) -> None:
        box = self._box(src, dst, key)
        if box.on_arrival is not None or box.waiter is not None:
            raise RuntimeError(f"message {key} from rank {src} to rank {dst} received twice")
        if box.arrived:
            del self._mailboxes[(src, dst, key)]
            self._received += 1
            assert box.payload is not None
            on_arrival(box.payload)
            return
        box.on_arrival = on_arrival

    async def send(self, src: int, dst: int, key: MessageKey, payload: HostArray) -> None:
        self.deliver(src, dst, key, payload)

    async def recv(self, dst: int, src: int, key: MessageKey) -> HostArray:
        box = self._box(src, dst, key)
        if not box.arrived:
            if box.on_arrival is not None or box.waiter is not None:
                raise RuntimeError(f"message {key} from rank {src} to rank {dst} received twice")
            box.waiter = anyio.Event()
            await box.waiter.wait()
        del self._mailboxes[(src, dst, key)]
        self._received += 1
        assert box.payload is not None
        return box.payload

    def stats(self) -> TransportStats:
        undelivered = sum(1 for box in self._mailboxes.values() if box.arrived)
        return TransportStats(self._sent, self._received, self._bytes_sent, undelivered)

    def reset(self) -> None:
        """Drop undelivered messages (after a failed or cancelled run)."""
        self._mailboxes.clear()
        self._rendezvous.clear()
        self._collective_calls.clear()

    async def all_gather(
        self, rank: int, group: tuple[int, ...], key: str, array: HostArray
    ) -> list[HostArray]:
        """Every member's ``array`` (the arrays themselves, not copies), in group order."""
        if not isinstance(array, np.ndarray):
            raise TypeError(f"array must be a numpy.ndarray, got {type(array).__name__}")
        found = await self._rendezvous_wait("all_gather", rank, group, key, (array,))
        return [found[index][0] for index in range(len(group))]

    async def reduce_scatter_sum(
        self, rank: int, group: tuple[int, ...], key: str, arrays: list[HostArray]
    ) -> HostArray:
        """The sum over members of their ``arrays[i]`` (``group[i] == rank``), a left fold
        in group order (bit-identical from run to run), in a new array."""
        if len(arrays) != len(group) or not all(isinstance(a, np.ndarray) for a in arrays):
            raise ValueError(
                f"arrays must hold {len(group)} numpy arrays, one per member of group "
                f"{group}, got {len(arrays)} items"
            )
        found = await self._rendezvous_wait("reduce_scatter_sum", rank, group, key, tuple(arrays))
        mine = group.index(rank)
        parts = [found[index][mine] for index in range(len(group))]
        for index, part in enumerate(parts):
            if part.shape != parts[mine].shape or part.dtype != parts[mine].dtype:
                raise ValueError(
                    f"reduce_scatter_sum {key!r}: rank {group[index]} sent {part.shape} "
                    f"{part.dtype}, rank {rank} expects {parts[mine].shape} {parts[mine].dtype}"
                )
        total = parts[0].copy()
        for part in parts[1:]:
            total += part
        return total

    async def _rendezvous_wait(
        self,
        op: str,
        rank: int,
        group: tuple[int, ...],
        key: str,
        payload: tuple[HostArray, ...],
    ) -> dict[int, tuple[HostArray, ...]]:
        """Wait until every member of ``group`` contributed to the same call; return the
        contributions by member index. The n-th call of ``(op, group, key)`` by each member
        meet (a key may be reused, as with MPITransport)."""
        if not isinstance(group, tuple) or not group or rank not in group:
            raise ValueError(f"group must be a tuple of ranks holding rank {rank}, got {group!r}")
        if len(set(group)) != len(group):
            raise ValueError(f"group must hold distinct ranks, got {group!r}")
        members = tuple(sorted(group))
        call = (op, members, key, rank)
        count = self._collective_calls.get(call, 0)
        self._collective_calls[call] = count + 1
        slot_key = (op, members, key, count)
        slot = self._rendezvous.get(slot_key)
        if slot is None:
            slot = self._rendezvous[slot_key] = _Rendezvous(group)
        if slot.group != group:
            raise RuntimeError(
                f"{op} {key!r}: members disagree on the group order: {slot.group} and {group}"
            )
        slot.contributions[group.index(rank)] = payload
        if len(slot.contributions) == len(group):
            slot.complete.set()
        await slot.complete.wait()
        slot.taken += 1
        if slot.taken == len(group):
            del self._rendezvous[slot_key]
        return slot.contributions


class P2PActor:
    """Serves one rank's SendRequest / RecvRequest messages through a Transport."""

    actor_name = "p2p"

    def __init__(
        self,
        rank: int,
        transport: Transport,
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
        self._pending: dict[int, str] = {}
        recorder.register_pending(rank, self.actor_name, lambda: sorted(self._pending.values()))

    async def run(self) -> None:
        """Serve requests until the request channel closes, then wait for those in flight."""
        immediate = self._transport if self._faults is None else None
        if not isinstance(immediate, ImmediateTransport):
            immediate = None
        async with anyio.create_task_group() as tg, self._requests:
            while True:
                try:
                    request = self._requests.receive_nowait()
                except anyio.WouldBlock:
                    try:
                        request = await self._requests.receive()
                    except anyio.EndOfStream:
                        return
                except anyio.EndOfStream:
                    return
                if immediate is not None and not isinstance(request, CollectiveRequest):
                    self._serve_now(immediate, request)
                else:
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
            event = "send" if isinstance(request, SendRequest) else "recv"
            log_step(self._log, event, request.step, self._generation, peer=request.step.peer)

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
                event = label.split(" ", 1)[0]
                log_step(self._log, event, step, self._generation, peer=step.peer)
        except Exception as exc:
            error = self._named(exc, label, step)
            request.reply.fail(error)
            raise error from exc
        finally:
            self._pending.pop(id(request), None)

    def _named(self, error: Exception, label: str, step: MetaStep) -> PipelineError:
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
