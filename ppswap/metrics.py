"""A metrics snapshot per rank, in a form an exporter maps one to one, and the loop's lag.

``rank_metrics(result, loop_lag_s=...)`` turns a ``RunResult`` into one ``RankMetrics``
per rank: flat, frozen, every field a number with its unit in its name and its meaning in
the field's ``metadata["help"]``. An exporter makes one gauge per field
(``metric_fields()``: name and help), labelled by rank; nothing is computed there.

``LoopLagMonitor`` measures the event loop's lag (how late a timer fires: how long the
loop was kept from answering anything else) while it is open, in its own task group:

    async with LoopLagMonitor() as lag:
        result = await run_schedule(...)
        snapshot = rank_metrics(result, loop_lag_s=lag.take_max_s())
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from types import TracebackType

import anyio
from anyio.abc import TaskGroup

from ppswap.results import RunResult

__all__ = ["LoopLagMonitor", "RankMetrics", "metric_fields", "rank_metrics"]

DEFAULT_LAG_INTERVAL_S = 0.005


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMetrics:
    """What one rank measured in one run (a training step); ``rank`` is the label, every
    other field a gauge (``metadata["help"]`` says what it is)."""

    rank: int
    generation: int = field(metadata=_help("the run's generation number"))
    step_time_s: float = field(metadata=_help("seconds of the whole run (all its ranks)"))
    compute_busy_s: float = field(
        metadata=_help("seconds of compute-thread work this rank's steps took")
    )
    peak_saved_bytes: int = field(
        metadata=_help("peak bytes of saved activations held on the device for backward")
    )
    offloaded_bytes: int = field(metadata=_help("bytes swap moved to the host"))
    loaded_bytes: int = field(metadata=_help("bytes swap brought back to the device"))
    exposed_copy_wait_s: float = field(
        metadata=_help("seconds compute waited for swap copies (copy time not hidden)")
    )
    copy_busy_s: float = field(metadata=_help("seconds the copy stream was busy"))
    event_loop_lag_s: float = field(
        metadata=_help("the event loop's largest lag measured during the run, in seconds")
    )


def metric_fields() -> Iterator[tuple[str, str]]:
    """``(name, help)`` of every gauge field of ``RankMetrics`` (all but ``rank``)."""
    for item in fields(RankMetrics):
        if item.name != "rank":
            yield item.name, str(item.metadata["help"])


def rank_metrics(result: RunResult, *, loop_lag_s: float = 0.0) -> tuple[RankMetrics, ...]:
    """One ``RankMetrics`` per rank of ``result``, in rank order; ``loop_lag_s``: the
    loop's lag during the run (``LoopLagMonitor``), the same for every rank of the
    process."""
    if isinstance(loop_lag_s, bool) or not isinstance(loop_lag_s, int | float) or loop_lag_s < 0:
        raise ValueError(f"loop_lag_s must be a number of seconds >= 0, got {loop_lag_s!r}")
    return tuple(
        RankMetrics(
            rank=stats.rank,
            generation=result.generation,
            step_time_s=result.step_time_s,
            compute_busy_s=float(sum(stats.compute_job_s.values())),
            peak_saved_bytes=stats.peak_saved_bytes,
            offloaded_bytes=stats.offloaded_bytes,
            loaded_bytes=stats.loaded_bytes,
            exposed_copy_wait_s=stats.exposed_copy_wait_s,
            copy_busy_s=stats.copy_busy_s,
            event_loop_lag_s=float(loop_lag_s),
        )
        for stats in result.ranks
    )


class LoopLagMonitor:
    """While open, a task in its own task group sleeps ``interval_s`` again and again and
    records how late it wakes: the loop's lag. ``take_max_s()`` returns the largest since
    the last take (0.0 if none) and starts over; ``max_s`` is the largest since opening."""

    def __init__(self, interval_s: float = DEFAULT_LAG_INTERVAL_S) -> None:
        if isinstance(interval_s, bool) or not isinstance(interval_s, int | float):
            raise ValueError(f"interval_s must be a number of seconds > 0, got {interval_s!r}")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be a number of seconds > 0, got {interval_s!r}")
        self.interval_s = float(interval_s)
        self.max_s = 0.0
        self.samples = 0
        self._window_max_s = 0.0
        self._group: TaskGroup | None = None

    def take_max_s(self) -> float:
        taken, self._window_max_s = self._window_max_s, 0.0
        return taken

    async def _watch(self) -> None:
        while True:
            started = time.perf_counter()
            await anyio.sleep(self.interval_s)
            lag = max(0.0, time.perf_counter() - started - self.interval_s)
            self.samples += 1
            self.max_s = max(self.max_s, lag)
            self._window_max_s = max(self._window_max_s, lag)

    async def __aenter__(self) -> LoopLagMonitor:
        if self._group is not None:
            raise RuntimeError("LoopLagMonitor is already open")
        self._group = anyio.create_task_group()
        await self._group.__aenter__()
        self._group.start_soon(self._watch, name="ppswap-loop-lag")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        group, self._group = self._group, None
        assert group is not None
        group.cancel_scope.cancel()
        return await group.__aexit__(exc_type, exc, tb)
