"""The copy-stream actor: one FIFO copy stream per rank.

Copies are served strictly in arrival order, one at a time, on the rank's own copy thread
(never the compute thread, never the event loop): offload and load never run in parallel,
as on a single device copy stream. Each request's reply future resolves with the bytes
moved, or with the copy's error (the same ``PipelineError`` this actor raises, so the
run reports the copy, not the compute step that waited for it).

A copy handed to the thread is waited for even when the run is cancelled (shielded), so
no copy is in flight once this actor has exited; that wait is bounded by ``timeout_s``
(then the actor raises ``PipelineHangError``). A ``FaultPlan`` (tests) can fail or delay
a copy before it starts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import anyio
import structlog
from anyio.abc import ObjectReceiveStream

from ppswap.actors.executor import DedicatedThread
from ppswap.actors.faults import FaultAction, FaultPlan, FaultSite
from ppswap.actors.messages import CopyRequest
from ppswap.actors.trace import FlightRecorder
from ppswap.errors import PipelineError, PipelineHangError
from ppswap.logs import log_step
from ppswap.scheduler.steps import MetaStep

__all__ = ["CopyStats", "CopyStreamActor"]


@dataclass(frozen=True, slots=True)
class CopyStats:
    copies: int
    bytes_copied: int
    busy_s: float


class CopyStreamActor:
    """Serves CopyRequests FIFO on a dedicated copy thread."""

    actor_name = "copy"

    def __init__(
        self,
        rank: int,
        thread: DedicatedThread,
        requests: ObjectReceiveStream[CopyRequest],
        recorder: FlightRecorder,
        *,
        generation: int = 0,
        log_steps: bool = False,
        timeout_s: float = math.inf,
        faults: FaultPlan | None = None,
    ) -> None:
        self.rank = rank
        self._timeout_s = timeout_s
        self._faults = faults
        self._generation = generation
        self._log_steps = log_steps
        self._log = structlog.get_logger("ppswap").bind(rank=rank, actor=self.actor_name)
        self.thread = thread
        self._requests = requests
        self._recorder = recorder
        self._copies = 0
        self._bytes = 0
        self._busy_s = 0.0
        self._queued: list[str] = []
        recorder.register_pending(rank, self.actor_name, lambda: list(self._queued))

    def stats(self) -> CopyStats:
        return CopyStats(self._copies, self._bytes, self._busy_s)

    async def run(self) -> None:
        async with self._requests:
            async for request in self._requests:
                await self._serve(request)

    async def _serve(self, request: CopyRequest) -> None:
        step = request.step
        label = f"copy {step.short()} {request.job.nbytes}B"
        self._queued.append(label)
        started = time.perf_counter()
        try:
            with self._recorder.span(
                self.rank,
                self.actor_name,
                step.kind.value,
                chunk=step.short(),
                bytes=request.job.nbytes,
            ):
                if self._faults is not None:
                    await self._inject(self._faults, step)
                # Shielded: a copy already handed to the thread runs to completion anyway;
                # waiting for it keeps "no copy in flight" true once this actor has exited.
                with anyio.CancelScope(shield=True) as shield:
                    shield.deadline = anyio.current_time() + self._timeout_s
                    moved = await self.thread.run(request.job.run)
                if shield.cancelled_caught:
                    raise PipelineHangError(
                        f"copy still running after {self._timeout_s}s",
                        rank=self.rank,
                        actor=self.actor_name,
                        step=step.short(),
                        dump=self._recorder.dump(),
                    )
        except PipelineError as failure:
            if not request.reply.done:
                request.reply.set_exception(failure)
            raise
        except Exception as exc:
            error = PipelineError(
                f"copy failed: {exc!r}",
                rank=self.rank,
                actor=self.actor_name,
                step=step.short(),
            )
            if not request.reply.done:
                request.reply.set_exception(error)
            raise error from exc
        finally:
            self._queued.remove(label)
        self._busy_s += time.perf_counter() - started
        self._copies += 1
        self._bytes += moved
        request.reply.set_result(moved)
        if self._log_steps:
            seconds = time.perf_counter() - started
            log_step(self._log, "copy", step, self._generation, bytes=moved, seconds=seconds)

    async def _inject(self, faults: FaultPlan, step: MetaStep) -> None:
        """Apply the plan's copy rule for ``step``: fail the copy, or hold the stream."""
        rule = faults.match(FaultSite.COPY, self.rank, step)
        if rule is None:
            return
        self._recorder.note(self.rank, self.actor_name, rule.describe(self.rank, step))
        if rule.action is FaultAction.DELAY:
            await anyio.sleep(rule.delay_s)
        else:
            rule.raise_fault(self.rank, step)
