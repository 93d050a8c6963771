"""Flight recorder (the last N events per actor) and Chrome/Perfetto trace export.

Every actor records a begin and an end event per MetaStep it serves. The flight recorder
keeps only the last ``capacity`` events per (rank, actor), always on, so a hang or a failure
can say what each actor did last; an event is kept as its parts and a timestamp and only
formatted when a dump is written (recording costs a tuple, not a string). Full spans are
kept only when a trace file was asked for. Any thread may record (the copy threads do).

The dump (``FlightRecorder.dump``, carried by every ``PipelineHangError``) lists, per
(rank, actor), the last events and what the actor is waiting for (its registered
``pending`` probe), then the statistics of every registered channel (buffered items,
open ends, tasks blocked on either end: ``anyio`` memory object streams), then the
process-wide status probes (the compute thread's current job, the transport's counters).
The actors' probes and the channels are held weakly: the recorder observes a run's
actors, which refer to it, and a strong reference back would keep every finished run's
actors (and what they hold) alive in a reference cycle until the garbage collector
finds it.
"""

from __future__ import annotations

import json
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from anyio.streams.memory import MemoryObjectStreamStatistics

from ppswap.scheduler.steps import MetaStep

__all__ = ["ROUNDING_MARGIN_S", "FlightRecorder", "TraceSpan"]

ACTOR_ORDER = ("compute", "p2p", "copy")
ROUNDING_MARGIN_S = 2e-9
"""The trace rounds times to 1 ns: spans drawn in a gap, or around other spans, keep this
margin on each side so that they do not overlap their neighbours after rounding."""


def _text(part: object) -> str:
    return part.short() if isinstance(part, MetaStep) else str(part)


class ChannelLike(Protocol):
    """Either end of an ``anyio`` memory object stream (both report the same state)."""

    def statistics(self) -> MemoryObjectStreamStatistics: ...


def describe_channel(stats: MemoryObjectStreamStatistics) -> str:
    """One line of channel statistics for a dump."""
    return (
        f"{stats.current_buffer_used}/{stats.max_buffer_size} buffered, "
        f"{stats.open_send_streams} senders, {stats.open_receive_streams} receivers open, "
        f"{stats.tasks_waiting_send} tasks waiting to send, "
        f"{stats.tasks_waiting_receive} waiting to receive"
    )


@dataclass(frozen=True, slots=True)
class TraceSpan:
    """One finished span: a MetaStep (or a copy) served by an actor of a rank."""

    rank: int
    actor: str
    name: str
    start_us: float
    duration_us: float
    args: tuple[tuple[str, Any], ...] = ()


class FlightRecorder:
    """Per-(rank, actor) ring buffers of recent events, plus optional full spans."""

    def __init__(self, *, capacity: int = 32, keep_spans: bool = False) -> None:
        self._capacity = capacity
        self._keep_spans = keep_spans
        self._origin = time.perf_counter()
        self._events: dict[tuple[int, str], deque[tuple[float, tuple[object, ...]]]] = {}
        self._spans: list[TraceSpan] = []
        self._pending: dict[tuple[int, str], weakref.WeakMethod[Callable[[], list[str]]]] = {}
        self._channels: dict[tuple[int, str], weakref.ref[ChannelLike]] = {}
        self._status: dict[str, Callable[[], str]] = {}

    @property
    def keeps_spans(self) -> bool:
        return self._keep_spans

    def now_us(self) -> float:
        return (time.perf_counter() - self._origin) * 1e6

    def note(self, rank: int, actor: str, *parts: object) -> None:
        """Record an event: ``parts`` are joined with spaces in a dump (a MetaStep as its
        ``short()`` name, anything else as ``str()``)."""
        ring = self._events.get((rank, actor))
        if ring is None:
            ring = self._events.setdefault((rank, actor), deque(maxlen=self._capacity))
        ring.append((time.perf_counter(), parts))

    def add_span(self, rank: int, actor: str, name: str, start_us: float, **args: Any) -> None:
        if self._keep_spans:
            end = self.now_us()
            self._spans.append(
                TraceSpan(rank, actor, name, start_us, end - start_us, tuple(args.items()))
            )

    def add_timed_span(
        self, rank: int, actor: str, name: str, started: float, seconds: float, **args: Any
    ) -> None:
        """A span measured elsewhere: ``started`` a ``time.perf_counter()`` reading."""
        if self._keep_spans:
            start_us = (started - self._origin) * 1e6
            self._spans.append(
                TraceSpan(rank, actor, name, start_us, seconds * 1e6, tuple(args.items()))
            )

    def add_batch_spans(
        self,
        rank: int,
        actor: str,
        steps: Sequence[MetaStep],
        started: Sequence[float],
        seconds: Sequence[float],
        posted: Sequence[tuple[int, MetaStep]] = (),
    ) -> None:
        """Spans of a compute batch: ``steps`` timed on the compute thread (``started``
        ``perf_counter`` readings, ``seconds``); ``posted`` are ``(n, step)``, a step
        posted ahead of the batch that comes after its n-th step in the order, drawn in
        the gap after that step (so the lane shows the order, not the early post)."""
        if not self._keep_spans:
            return
        for count, (step, begin, duration) in enumerate(
            zip(steps, started, seconds, strict=True), 1
        ):
            self.add_timed_span(rank, actor, step.short(), begin, duration)
            between = [later for after, later in posted if after == count]
            if not between:
                continue
            gap_start = begin + duration + ROUNDING_MARGIN_S
            gap_end = started[count] if count < len(steps) else time.perf_counter()
            share = max(0.0, gap_end - ROUNDING_MARGIN_S - gap_start) / len(between)
            for index, later in enumerate(between):
                self.add_timed_span(rank, actor, later.short(), gap_start + index * share, share)

    @contextmanager
    def span(self, rank: int, actor: str, name: str, **args: Any) -> Iterator[None]:
        """Record ``name`` as begun, then ended (or failed) on (rank, actor)."""
        start = self.now_us()
        self.note(rank, actor, "begin", name)
        try:
            yield
        except BaseException as exc:
            self.note(rank, actor, "FAILED", f"{name}:", type(exc).__name__)
            raise
        self.note(rank, actor, "end", name)
        self.add_span(rank, actor, name, start, **args)

    def register_pending(self, rank: int, actor: str, probe: Callable[[], list[str]]) -> None:
        """Let an actor report what it is waiting for in a dump. ``probe`` is a bound
        method of the actor (held weakly: an actor that is gone reports nothing)."""
        self._pending[(rank, actor)] = weakref.WeakMethod(probe)

    def register_channel(self, rank: int, name: str, channel: ChannelLike) -> None:
        """Report ``channel``'s statistics in a dump, as ``rank``'s channel ``name``
        (held weakly: a channel that is gone reports nothing)."""
        self._channels[(rank, name)] = weakref.ref(channel)

    def register_status(self, name: str, probe: Callable[[], str]) -> None:
        """Report ``probe()`` in a dump under ``name`` (process-wide state)."""
        self._status[name] = probe

    @property
    def spans(self) -> tuple[TraceSpan, ...]:
        return tuple(self._spans)

    def dump(self) -> str:
        """A readable dump: per actor the last events and what it is waiting for."""
        lines = ["flight recorder:"]
        keys = sorted(
            set(self._events) | set(self._pending),
            key=lambda k: (k[0], ACTOR_ORDER.index(k[1]) if k[1] in ACTOR_ORDER else 99),
        )
        for rank, actor in keys:
            lines.append(f"  rank {rank} {actor}:")
            for at, parts in list(self._events.get((rank, actor), ())):
                text = " ".join(_text(part) for part in parts)
                lines.append(f"    {(at - self._origin) * 1e3:10.3f}ms {text}")
            probe_ref = self._pending.get((rank, actor))
            probe = None if probe_ref is None else probe_ref()
            if probe is not None:
                for item in probe():
                    lines.append(f"    pending: {item}")
        if self._channels:
            lines.append("channels:")
            for (rank, name), channel_ref in sorted(self._channels.items(), key=lambda kv: kv[0]):
                channel = channel_ref()
                if channel is not None:
                    stats = describe_channel(channel.statistics())
                    lines.append(f"  rank {rank} {name}: {stats}")
        if self._status:
            lines.append("process:")
            for name, status in self._status.items():
                lines.append(f"  {name}: {status()}")
        return "\n".join(lines)

    def write_chrome_trace(self, path: str | Path) -> Path:
        """Write the spans as a Chrome/Perfetto JSON trace: a process per rank, a thread
        (lane) per actor."""
        events: list[dict[str, Any]] = []
        lanes = sorted({(s.rank, s.actor) for s in self._spans})
        for rank in sorted({rank for rank, _ in lanes}):
            events.append(
                {"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}}
            )
        for rank, actor in lanes:
            tid = ACTOR_ORDER.index(actor) if actor in ACTOR_ORDER else len(ACTOR_ORDER)
            events.append(
                {"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": actor}}
            )
        for s in self._spans:
            events.append(
                {
                    "ph": "X",
                    "name": s.name,
                    "pid": s.rank,
                    "tid": ACTOR_ORDER.index(s.actor) if s.actor in ACTOR_ORDER else 3,
                    "ts": round(s.start_us, 3),
                    "dur": round(max(s.duration_us, 0.001), 3),
                    "args": {k: v for k, v in s.args},
                }
            )
        out = Path(path)
        out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
        return out
