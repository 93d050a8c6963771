"""The P2P actor and the Transport it talks through.

``P2PActor`` serves the sends and receives of one rank. Each request is served by its own
task in the actor's task group, so a receive waiting for a slow peer never holds up a send
or another receive; the result (or the error) resolves the request's reply future.

``Transport`` is the seam to the outside world: ``InProcessTransport`` (every rank in this
process and event loop, the embedded default) and ``MPITransport`` (``ppswap.actors.mpi``:
one process per rank over mpi4py). Payloads are host numpy arrays; a message is identified
by ``(src, dst, MessageKey)``, which is unique within a run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import anyio
import numpy as np
from anyio.abc import ObjectReceiveStream

from ppswap.actors.messages import MessageKey, RecvRequest, SendRequest
from ppswap.actors.trace import FlightRecorder
from ppswap.errors import PipelineError

__all__ = ["InProcessTransport", "P2PActor", "Transport", "TransportStats"]


@dataclass(frozen=True, slots=True)
class TransportStats:
    messages_sent: int
    messages_received: int
    bytes_sent: int
    undelivered: int


@runtime_checkable
class Transport(Protocol):
    """Moves host arrays between ranks. Both calls may be awaited concurrently."""

    async def send(self, src: int, dst: int, key: MessageKey, payload: np.ndarray) -> None:
        """Deliver ``payload``; returns once the payload buffer may be reused."""
        ...

    async def recv(self, dst: int, src: int, key: MessageKey) -> np.ndarray:
        """Wait for the message ``key`` from ``src`` and return its payload."""
        ...

    def stats(self) -> TransportStats: ...


@dataclass(slots=True)
class _Mailbox:
    arrived: anyio.Event = field(default_factory=anyio.Event)
    payload: np.ndarray | None = None


class InProcessTransport:
    """All ranks in one process and one event loop: a mailbox per message.

    A send never blocks (the payload is parked in the mailbox until its receiver takes
    it), which is the buffered-send semantics the schedule validator assumes.
    """

    def __init__(self) -> None:
        self._mailboxes: dict[tuple[int, int, MessageKey], _Mailbox] = {}
        self._sent = 0
        self._received = 0
        self._bytes_sent = 0

    def _box(self, src: int, dst: int, key: MessageKey) -> _Mailbox:
        box = self._mailboxes.get((src, dst, key))
        if box is None:
            box = self._mailboxes[(src, dst, key)] = _Mailbox()
        return box

    async def send(self, src: int, dst: int, key: MessageKey, payload: np.ndarray) -> None:
        box = self._box(src, dst, key)
        if box.arrived.is_set():
            raise RuntimeError(f"message {key} from rank {src} to rank {dst} sent twice")
        box.payload = payload
        box.arrived.set()
        self._sent += 1
        self._bytes_sent += payload.nbytes

    async def recv(self, dst: int, src: int, key: MessageKey) -> np.ndarray:
        box = self._box(src, dst, key)
        await box.arrived.wait()
        del self._mailboxes[(src, dst, key)]
        self._received += 1
        assert box.payload is not None
        return box.payload

    def stats(self) -> TransportStats:
        undelivered = sum(1 for box in self._mailboxes.values() if box.arrived.is_set())
        return TransportStats(self._sent, self._received, self._bytes_sent, undelivered)

    def reset(self) -> None:
        """Drop undelivered messages (after a failed or cancelled run)."""
        self._mailboxes.clear()


class P2PActor:
    """Serves one rank's SendRequest / RecvRequest messages through a Transport."""

    actor_name = "p2p"

    def __init__(
        self,
        rank: int,
        transport: Transport,
        requests: ObjectReceiveStream[SendRequest | RecvRequest],
        recorder: FlightRecorder,
        *,
        timeout_s: float = math.inf,
    ) -> None:
        self.rank = rank
        self._transport = transport
        self._requests = requests
        self._recorder = recorder
        self._timeout_s = timeout_s
        self._pending: dict[int, str] = {}
        recorder.register_pending(rank, self.actor_name, lambda: sorted(self._pending.values()))

    async def run(self) -> None:
        """Serve requests until the request channel closes, then wait for those in flight."""
        async with anyio.create_task_group() as tg, self._requests:
            async for request in self._requests:
                tg.start_soon(self._serve, request)

    async def _serve(self, request: SendRequest | RecvRequest) -> None:
        step = request.step
        if isinstance(request, SendRequest):
            label = f"send {request.key.direction}{request.key.micro}->s{request.key.stage}"
            label += f" to rank {request.dst}"
        else:
            label = f"recv {request.key.direction}{request.key.micro}->s{request.key.stage}"
            label += f" from rank {request.src}"
        self._pending[id(request)] = label
        try:
            with self._recorder.span(self.rank, self.actor_name, label, step=step.short()):
                if isinstance(request, SendRequest):
                    await self._transport.send(
                        self.rank, request.dst, request.key, request.payload
                    )
                    request.reply.set_result(None)
                else:
                    payload = await self._transport.recv(self.rank, request.src, request.key)
                    request.reply.set_result(payload)
        except Exception as exc:
            if not request.reply.done:
                request.reply.set_exception(exc)
            raise PipelineError(
                f"{label} failed: {exc!r}", rank=self.rank, actor=self.actor_name,
                step=step.short(),
            ) from exc
        finally:
            self._pending.pop(id(request), None)
