"""The copy-stream actor: one FIFO copy stream per rank.

Copies are served strictly in arrival order, one at a time, on the rank's own copy thread
(never the compute thread, never the event loop): offload and load never run in parallel,
as on a single device copy stream. Each request's reply future resolves with the bytes
moved, or with the copy's error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import anyio
import structlog
from anyio.abc import ObjectReceiveStream

from ppswap.actors.executor import DedicatedThread
from ppswap.actors.messages import CopyRequest
from ppswap.actors.trace import FlightRecorder
from ppswap.errors import PipelineError

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
    ) -> None:
        self.rank = rank
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
                # Shielded: a copy already handed to the thread runs to completion anyway;
                # waiting for it keeps "no copy in flight" true once this actor has exited.
                with anyio.CancelScope(shield=True):
                    moved = await self.thread.run(request.job.run)
        except Exception as exc:
            if not request.reply.done:
                request.reply.set_exception(exc)
            raise PipelineError(
                f"copy failed: {exc!r}",
                rank=self.rank,
                actor=self.actor_name,
                step=step.short(),
            ) from exc
        finally:
            self._queued.remove(label)
        self._busy_s += time.perf_counter() - started
        self._copies += 1
        self._bytes += moved
        request.reply.set_result(moved)
        if self._log_steps:
            self._log.debug(
                "copy",
                step=step.kind.value,
                stage=step.stage,
                micro=step.micro,
                generation=self._generation,
                bytes=moved,
                seconds=time.perf_counter() - started,
            )
