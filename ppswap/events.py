"""Progress as it happens: a bounded stream of typed events from the runs of a caller.

    events = RunEvents(capacity=1024)
    async with anyio.create_task_group() as tg:
        tg.start_soon(show, events)          # async for event in events: ...
        await run_schedule(stages, ..., events=events)
        events.close()                       # the consumer's loop then ends

Design (the simplest that is safe):

- One ``RunEvents`` per consumer, passed to ``run_schedule(..., events=...)``; it may
  serve many runs one after another (a training job's steps) and ends when its owner
  ``close()``-s it (``async with RunEvents() as events`` closes it on exit).
- The runtime's actors ``emit`` on the event loop's thread (every emit point is there:
  run start and end in ``run_schedule``, a rank's order done and a chunk's copy waited
  for in its compute actor, where the step's result is applied). ``emit`` appends to a
  ``collections.deque`` and sets the consumer's wake-up event: it never blocks, never
  awaits, never fails for lack of a consumer. ``emit`` is not for other threads.
- Bounded: at ``capacity`` a new event drops the oldest one. The consumer is told:
  before the next event it gets, an ``EventsDropped`` with how many it missed since the
  last one (``dropped`` counts them all). A slow consumer never slows the run.
- One consumer: ``async for`` over the stream from one task at a time (a second
  concurrent reader is a ``RuntimeError``). A consumer's wait ends at the next event or at
  ``close()``; ``next_event(timeout_s)`` waits with a deadline.

Every event is a frozen dataclass with ``generation`` (the run's number, as in
``RunResult.generation``) and ``time_s`` (``time.time()`` when it was emitted).

``RunEvents(timeline=True)`` asks the runs for their timeline: each ``RunFinished`` then
carries every step each actor of each rank served (``TimelineSpan``: compute steps, the
copy stream's copies, the P2P actor's sends and receives), the spans a Chrome trace
draws, kept for the run (a little memory per step).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from types import TracebackType

import anyio

from ppswap.results import RunResult

__all__ = [
    "ChunkEvent",
    "ChunkLoaded",
    "ChunkOffloaded",
    "EventsDropped",
    "RankOrderFinished",
    "RunCancelled",
    "RunEvent",
    "RunEvents",
    "RunFailed",
    "RunFinished",
    "RunStarted",
    "TimelineSpan",
]

DEFAULT_EVENT_CAPACITY = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class RunStarted:
    """A run began: its ranks in this process, schedule, swap and micro-batch count."""

    generation: int
    ranks: tuple[int, ...]
    schedule: str
    swap: bool
    micro_batch_num: int
    time_s: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkEvent:
    """A chunk's copy was waited for: chunk (``stage``, ``micro``) of ``rank``.
    ``bytes``: what moved; ``waited_s``: how long compute waited for the copy. Emitted as
    one of its two kinds, ``ChunkOffloaded`` or ``ChunkLoaded``."""

    generation: int
    rank: int
    stage: int
    micro: int
    bytes: int
    waited_s: float
    time_s: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkOffloaded(ChunkEvent):
    """The chunk is on the host: its SWAP_WAIT_OFFLOAD ended (fields: ``ChunkEvent``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChunkLoaded(ChunkEvent):
    """The chunk is back on the device: its SWAP_WAIT_LOAD ended (fields: ``ChunkEvent``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankOrderFinished:
    """``rank`` ran the last step of its order (its sends delivered): ``steps_executed``
    steps in ``elapsed_s`` since its compute actor started."""

    generation: int
    rank: int
    steps_executed: int
    elapsed_s: float
    time_s: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True)
class TimelineSpan:
    """A step an actor (``compute``, ``copy``, ``p2p``) of ``rank`` served: its name (a
    MetaStep's short name, or a copy's), start (seconds since the run began) and length."""

    rank: int
    actor: str
    name: str
    start_s: float
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFinished:
    """The run (one training step) ended well: its ``RunResult``; ``timeline``: its
    spans, in start order, when the stream asked for them (else empty)."""

    generation: int
    result: RunResult
    timeline: tuple[TimelineSpan, ...] = ()
    time_s: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunFailed:
    """The run failed and was torn down: the error's type and first line."""

    generation: int
    error_type: str
    message: str
    time_s: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True, kw_only=True)
class RunCancelled:
    """The run was cancelled and torn down (the same stages can run again)."""

    generation: int
    time_s: float = field(default_factory=time.time)


@dataclass(frozen=True, slots=True, kw_only=True)
class EventsDropped:
    """The consumer missed ``count`` events (the oldest, dropped at capacity) since the
    last event it got. Made by the stream for its consumer, never emitted by a run."""

    count: int
    generation: int = -1
    time_s: float = field(default_factory=time.time)


RunEvent = (
    RunStarted
    | ChunkOffloaded
    | ChunkLoaded
    | RankOrderFinished
    | RunFinished
    | RunFailed
    | RunCancelled
    | EventsDropped
)
"""Every type a ``RunEvents`` yields."""


class RunEvents:
    """A bounded, drop-oldest stream of ``RunEvent`` (see the module docstring).

    ``capacity``: how many events wait for the consumer at most (an int >= 1);
    ``timeline``: whether each ``RunFinished`` carries the run's ``TimelineSpan``-s."""

    def __init__(self, capacity: int = DEFAULT_EVENT_CAPACITY, *, timeline: bool = False) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        if not isinstance(timeline, bool):
            raise ValueError(f"timeline must be a bool, got {timeline!r}")
        self.capacity = capacity
        self.timeline = timeline
        self._buffer: deque[RunEvent] = deque()
        self._unreported_drops = 0
        self._dropped = 0
        self._emitted = 0
        self._closed = False
        self._wakeup: anyio.Event | None = None
        self._reading = False

    @property
    def dropped(self) -> int:
        """How many events were dropped at capacity, in all."""
        return self._dropped

    @property
    def emitted(self) -> int:
        """How many events were emitted, in all (dropped ones included)."""
        return self._emitted

    @property
    def closed(self) -> bool:
        return self._closed

    def emit(self, event: RunEvent) -> None:
        """Event loop's thread: queue ``event``, dropping the oldest at capacity. Never
        blocks; after ``close()`` the event is ignored."""
        if self._closed:
            return
        self._emitted += 1
        if len(self._buffer) >= self.capacity:
            self._buffer.popleft()
            self._dropped += 1
            self._unreported_drops += 1
        self._buffer.append(event)
        self._wake()

    def close(self) -> None:
        """No more events: the consumer gets what is queued, then its loop ends."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    def _take(self) -> RunEvent | None:
        if self._unreported_drops:
            count, self._unreported_drops = self._unreported_drops, 0
            return EventsDropped(count=count)
        return self._buffer.popleft() if self._buffer else None

    async def _wait(self) -> RunEvent | None:
        """The next event, or None once the stream is closed and drained."""
        if self._reading:
            raise RuntimeError("RunEvents has one consumer; another task is reading it")
        self._reading = True
        try:
            while True:
                event = self._take()
                if event is not None or self._closed:
                    return event
                self._wakeup = wakeup = anyio.Event()
                await wakeup.wait()
        finally:
            self._reading = False

    async def next_event(self, timeout_s: float) -> RunEvent | None:
        """The next event, waiting ``timeout_s`` at most: None when none came by then or
        the stream is closed and drained."""
        with anyio.move_on_after(timeout_s):
            return await self._wait()
        return None

    def __aiter__(self) -> RunEvents:
        return self

    async def __anext__(self) -> RunEvent:
        event = await self._wait()
        if event is None:
            raise StopAsyncIteration
        return event

    async def __aenter__(self) -> RunEvents:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
