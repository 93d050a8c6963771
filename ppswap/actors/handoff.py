"""ThreadHandoff: ranks that share the compute thread hand payloads over on it.

In-process ranks share one compute thread, and one rank's FWD output is the next rank's
FWD input. Through the actors it travels thread -> event loop (the batch's outcome) ->
P2P actor -> the receive's future -> its ``Arrival`` -> thread, so the receiving batch,
parked on that arrival, would wait for the sending batch to end and a turn of the loop
for a payload made on its own thread.

The handoff is a shortcut beside that path, not instead of it. The job that makes the
payload ``put``s it on the compute thread as soon as it is made, under the message it
travels as; the receiving rank's posted RECV ``expect``s it with its ``Arrival``;
whichever comes second lands the arrival, and the parked batch goes on. The message still
takes the actors' path (the P2P actor delivers, counts and traces it; resolving the
receive lands the arrival again, which is a no-op), so results, statistics, deadlines and
hang dumps stay as they are. Both paths carry the same object, never a copy. Because the
handoff carries the payload, the sender's batch does not announce it to the loop (one
wake-up per send saved): the send is posted with the batch's outcome, and no receiving
step of these ranks waits for it on the loop (every wait of a step is on the thread).

An entry lives until it is matched, or (an expectation) until its arrival lands another
way, so nothing is held for a message already received. A payload put for a receive that
is never posted stays until the run ends, as in ``InProcessTransport``'s mailbox. Any
thread may call either method.
"""

from __future__ import annotations

import threading
from functools import partial

from ppswap.core.arrival import Arrival
from ppswap.core.messages import MessageKey, Payload

__all__ = ["ThreadHandoff"]

_Slot = tuple[int, int, MessageKey]  # (src, dst, key)


class _Put:
    __slots__ = ("payload",)

    def __init__(self, payload: Payload) -> None:
        self.payload = payload


class ThreadHandoff:
    """Payloads handed between ranks of one process on their compute thread (module
    docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slots: dict[_Slot, Arrival | _Put] = {}

    def put(self, src: int, dst: int, key: MessageKey, payload: Payload) -> None:
        """Compute thread: rank ``src`` made the payload of message ``key`` to ``dst``."""
        slot = (src, dst, key)
        with self._lock:
            found = self._slots.pop(slot, None)
            if found is None:
                self._slots[slot] = _Put(payload)
                return
        if isinstance(found, _Put):
            raise RuntimeError(f"message {key} from rank {src} to rank {dst} put twice")
        found.land(payload)

    def expect(self, dst: int, src: int, key: MessageKey, arrival: Arrival) -> None:
        """Event loop: rank ``dst`` posted the receive of ``key`` from ``src``."""
        slot = (src, dst, key)
        with self._lock:
            found = self._slots.pop(slot, None)
            if found is None:
                self._slots[slot] = arrival
        if found is None:
            arrival.on_ready(partial(self._forget, slot, arrival))
        elif isinstance(found, _Put):
            arrival.land(found.payload)
        else:
            raise RuntimeError(f"message {key} from rank {src} to rank {dst} expected twice")

    def _forget(self, slot: _Slot, arrival: Arrival) -> None:
        with self._lock:
            if self._slots.get(slot) is arrival:
                del self._slots[slot]

    def __len__(self) -> int:
        """Entries not matched yet (tests, leak checks)."""
        with self._lock:
            return len(self._slots)
