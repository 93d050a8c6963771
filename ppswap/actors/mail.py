"""RankMail: what one rank's compute actor has in flight with the other actors.

- receives posted to the P2P actor, by message key, with the future their payload
  resolves (the consuming FWD/BWD reads it); with ``arrivals``, each future has an
  ``Arrival`` too, which a batch can take before the payload is there (its compute
  thread waits for it, ``core.arrival``);
- payloads produced by a leaf and not sent yet (the outbox, by the key they travel under);
- sends posted (their futures are awaited at the end of the order);
- copies launched on the copy stream, by ``(launch kind, stage, micro)``, until their
  SWAP_WAIT takes them (a batch's job may take one still running: its compute thread
  waits for it, and it is listed for hang dumps until it is done; a SWAP_WAIT in the
  batch of its launch takes the completion the launch will use, made beforehand, and the
  copy never enters ``copies``).

What a batch's jobs wait for on the compute thread is listed for hang dumps only: the
receives by weak reference (the mail never keeps a payload alive after its leaf ran),
the copies until done. Both lists are pruned when they have doubled since the last
prune, not at every addition: an in-process rank's batch is its whole order, and
pruning at every addition made building it quadratic.

Posting never blocks: the P2P channel is sized to every request of the order
(``send_nowait``). With a ``ThreadHandoff`` (ranks that share the compute thread), every
receive posted also expects its payload from the sender's compute thread, and
``hand_off(send)`` is what the sending job calls there. Everything else here runs on the
event loop.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

from ppswap.actors.copy_stream import CopyCompletion
from ppswap.actors.handoff import ThreadHandoff
from ppswap.actors.p2p import P2PChannel
from ppswap.core.arrival import Arrival
from ppswap.core.messages import MessageKey, Payload, RecvRequest, ReplyFuture, SendRequest
from ppswap.errors import PipelineError
from ppswap.scheduler.steps import RECV_KINDS as _RECVS
from ppswap.scheduler.steps import SWAP_LAUNCH_KINDS as _LAUNCHES
from ppswap.scheduler.steps import MetaStep, StepKind

__all__ = ["CopyKey", "RankMail", "send_key"]

CopyKey = tuple[StepKind, int, int]


_PRUNE_AT_LEAST = 8  # the lists of what the thread waits for are pruned from this size


def send_key(step: MetaStep) -> MessageKey:
    """The message a SEND_F / SEND_B sends: keyed by the stage that receives it."""
    return _sent_as("F" if step.kind is StepKind.SEND_F else "B", step.stage, step.micro)


def _sent_as(direction: str, stage: int, micro: int) -> MessageKey:
    """The message that carries stage ``stage``'s output (``"F"``) or input gradient
    (``"B"``) of micro-batch ``micro``: keyed by the stage that receives it."""
    return MessageKey(direction, stage + 1 if direction == "F" else stage - 1, micro)


class RankMail:
    """A rank's receives, outbox, sends and launched copies (see the module docstring).

    ``failure(step, message)`` makes the error for a step the order cannot run (a send
    before its producer, a leaf consuming a message nobody received). ``arrivals``: give
    every receive an ``Arrival`` (``take_arrival``); ``handoff`` (with ``arrivals``, for
    rank ``rank``): the arrivals are landed by the sender's compute thread too.
    """

    def __init__(
        self,
        p2p: P2PChannel,
        failure: Callable[[MetaStep, str], PipelineError],
        *,
        arrivals: bool = False,
        rank: int = -1,
        handoff: ThreadHandoff | None = None,
    ) -> None:
        if handoff is not None and not arrivals:
            raise ValueError("handoff needs arrivals=True: it lands a receive's Arrival")
        self._p2p = p2p
        self._failure = failure
        self._arrivals = arrivals
        self._rank = rank
        self._handoff = handoff
        self.recvs: dict[MessageKey, ReplyFuture[Payload]] = {}
        # taken by take_arrival, by weak reference (hang dumps; module docstring)
        self.awaited_on_thread: dict[MessageKey, weakref.ref[ReplyFuture[Payload]]] = {}
        self._prune_awaited_at = _PRUNE_AT_LEAST
        self.outbox: dict[MessageKey, Payload] = {}
        self.sends: list[ReplyFuture[None]] = []
        self.copies: dict[CopyKey, CopyCompletion] = {}
        # launched by a batch that also waits for them: never in ``copies``
        self.launched_in_batch: set[CopyKey] = set()
        self.copies_on_thread: list[CopyCompletion] = []  # pruned by copy_on_thread
        self._prune_copies_at = _PRUNE_AT_LEAST

    def post(self, step: MetaStep) -> None:
        """Hand a send or receive (or each of a BATCH_SEND_RECV's) to the P2P actor."""
        kind = step.kind
        if kind is StepKind.BATCH_SEND_RECV:
            for sub in step.sub_steps:
                self.post(sub)
            return
        assert step.peer is not None
        request: SendRequest | RecvRequest
        if kind in _RECVS:
            direction = "F" if kind is StepKind.RECV_F else "B"
            key = MessageKey(direction, step.stage, step.micro)
            label = f"{direction}{step.micro}.s{step.stage}"
            arrival = Arrival(label) if self._arrivals else None
            future: ReplyFuture[Any] = ReplyFuture(label, arrival)
            self.recvs[key] = future
            if self._handoff is not None and arrival is not None:
                self._handoff.expect(self._rank, step.peer, key, arrival)
            request = RecvRequest(step, key, step.peer, future)
        else:
            key = send_key(step)
            payload = self.outbox.pop(key, None)
            if payload is None:
                raise self._failure(step, f"{step.short()} sends {key} before its producer ran")
            future = ReplyFuture(f"{key.direction}{key.micro}.s{key.stage}")
            self.sends.append(future)
            request = SendRequest(step, key, step.peer, payload, future)
        self._p2p.send_nowait(request)

    def keep(self, step: MetaStep, result: Any) -> None:
        """File what a finished local step made, for the steps after it: a FWD's output
        or a BWD's dx in the outbox (under the message its SEND sends), a launch's copy
        completion in ``copies`` (unless its SWAP_WAIT_* ran in the same batch)."""
        kind = step.kind
        if kind is StepKind.FWD:
            self.outbox[_sent_as("F", step.stage, step.micro)] = result
        elif (kind is StepKind.BWD or kind is StepKind.BWD_INPUT) and result is not None:
            self.outbox[_sent_as("B", step.stage, step.micro)] = result
        elif kind in _LAUNCHES:
            key = (kind, step.stage, step.micro)
            if key in self.launched_in_batch:
                self.launched_in_batch.discard(key)
            else:
                self.copies[key] = result

    def hand_off(self, send: MetaStep) -> Callable[[Payload], None] | None:
        """What the job making the payload of ``send`` calls with it on the compute
        thread (None without a handoff)."""
        if self._handoff is None:
            return None
        assert send.peer is not None
        return partial(self._handoff.put, self._rank, send.peer, send_key(send))

    def received(self, key: MessageKey, step: MetaStep) -> ReplyFuture[Payload]:
        """The future of the receive ``step`` consumes (it must have been posted)."""
        future = self.recvs.get(key)
        if future is None:
            raise self._failure(step, f"{step.short()} consumes {key} but no RECV was posted")
        return future

    def take(self, key: MessageKey, step: MetaStep) -> tuple[bool, Payload]:
        """``(True, payload)`` once the receive of ``key`` arrived (it is taken), else
        ``(False, None)``; a failed receive raises its error."""
        future = self.received(key, step)
        if not future.done:
            return False, None
        del self.recvs[key]
        return True, future.result()

    def take_arrival(self, key: MessageKey, step: MetaStep) -> Arrival | None:
        """The ``Arrival`` of the receive of ``key``, taken (the caller's thread waits for
        it), while its payload is not there yet; None without arrivals or once it is
        there (``take`` it then)."""
        future = self.received(key, step)
        if future.done or future.arrival is None:
            return None
        del self.recvs[key]
        awaited = self.awaited_on_thread
        awaited[key] = weakref.ref(future)
        if len(awaited) >= self._prune_awaited_at:
            self.awaited_on_thread = awaited = {
                k: ref for k, ref in awaited.items() if _in_flight(ref)
            }
            self._prune_awaited_at = max(_PRUNE_AT_LEAST, 2 * len(awaited))
        return future.arrival

    def copy_on_thread(self, completion: CopyCompletion) -> None:
        """A copy still running that a batch's job waits for on the compute thread (it
        is listed by ``pending`` until it is done)."""
        awaited = self.copies_on_thread
        awaited.append(completion)
        if len(awaited) >= self._prune_copies_at:
            self.copies_on_thread = awaited = [c for c in awaited if not c.is_set()]
            self._prune_copies_at = max(_PRUNE_AT_LEAST, 2 * len(awaited))

    def pending(self) -> list[str]:
        """Receives, copies and sends still in flight (for hang dumps)."""
        items = [f"recv {f.label}" for f in self.recvs.values() if not f.done]
        awaited = [ref() for ref in self.awaited_on_thread.values()]
        items += [
            f"recv {f.label} (awaited on the compute thread)"
            for f in awaited
            if f is not None and not f.done
        ]
        items += [c.label for c in self.copies.values() if not c.is_set()]
        items += [
            f"{c.label} (awaited on the compute thread)"
            for c in self.copies_on_thread
            if not c.is_set()
        ]
        items += [f"send {f.label}" for f in self.sends if not f.done]
        return items

    def leftovers(self) -> str | None:
        """What the order left unconsumed (None when nothing: the order was complete)."""
        if not (self.recvs or self.copies or self.outbox):
            return None
        return (
            f"order ended with unconsumed receives {sorted(map(str, self.recvs))}, "
            f"copies {sorted(map(str, self.copies))} or sends {sorted(map(str, self.outbox))}"
        )


def _in_flight(ref: weakref.ref[ReplyFuture[Payload]]) -> bool:
    future = ref()
    return future is not None and not future.done
