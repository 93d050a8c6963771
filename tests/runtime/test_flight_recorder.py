"""The flight recorder observes a run's actors without keeping them alive."""

from __future__ import annotations

import weakref

import anyio
from cyclic_garbage import collector_off

from ppswap.actors.trace import FlightRecorder


class _Actor:
    """Stands in for an actor: it holds the recorder, as every actor does."""

    def __init__(self, recorder: FlightRecorder) -> None:
        self.recorder = recorder
        self.waiting = ["RECV_F s1 m0 from rank 0"]

    def pending(self) -> list[str]:
        return list(self.waiting)


def test_probes_and_channels_are_reported_while_alive_and_not_kept() -> None:
    """While the actor and its channel exist, the dump has the actor's pending items and
    the channel's statistics; the recorder holds both weakly, so dropping them frees them
    by reference counting (the actor refers to the recorder: a strong reference back
    would be a cycle), and the dump then leaves them out. The actor's events stay."""
    recorder = FlightRecorder()
    actor = _Actor(recorder)
    sender, receiver = anyio.create_memory_object_stream[int](4)
    recorder.register_pending(0, "compute", actor.pending)
    recorder.register_channel(0, "compute->p2p", sender)
    recorder.note(0, "compute", "begin", "FWD")
    sender.send_nowait(1)
    dump = recorder.dump()
    assert "pending: RECV_F s1 m0 from rank 0" in dump
    assert "rank 0 compute->p2p: 1/4 buffered" in dump
    with collector_off():
        gone = weakref.ref(actor), weakref.ref(sender)
        sender.close()
        receiver.close()
        del actor, sender, receiver
        assert [ref() for ref in gone] == [None, None]
    dump = recorder.dump()
    assert "begin FWD" in dump
    assert "pending" not in dump and "compute->p2p" not in dump
