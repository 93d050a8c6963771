"""Schedule classes: a schedule family bound to its stages and options, run many times.

``ScheduleGPipe(stages, micro_batch_num=8, loss_fn=loss, swap=True)`` checks its options
at once (they are a :class:`~ppswap.options.RunOptions`: a bad option fails at
construction; what depends on the stages and the data, such as ``pp`` against
``stage_num``, the run planner checks before any work of each run), owns the copy engine
(so host buffers are pooled across runs) and runs with ``await schedule.run_async(x,
targets=y)`` or, from synchronous code, ``schedule.run(x, targets=y)``.
``swap_policy="cost"`` with ``cost_model=CostModel(...)`` (``ppswap.scheduler.cost``)
chooses the swapped chunks by their copy cost instead of the fixed gap rule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import anyio

from ppswap.actors.runtime import run_schedule
from ppswap.options import RunOptions
from ppswap.results import RunResult
from ppswap.scheduler.config import ScheduleName
from ppswap.stage import LossFn, PipelineStage

__all__ = ["Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B"]


class _PipelineSchedule:
    schedule_name: ClassVar[ScheduleName]

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        micro_batch_num: int,
        *,
        loss_fn: LossFn | None = None,
        options: RunOptions | None = None,
        **option_fields: Any,
    ) -> None:
        """``option_fields``: any field of ``RunOptions`` but ``schedule`` (the class's)."""
        self.stages: list[PipelineStage] = (
            [stages] if isinstance(stages, PipelineStage) else list(stages)
        )
        if not self.stages or not all(isinstance(s, PipelineStage) for s in self.stages):
            raise TypeError(f"stages must be PipelineStage objects, got {stages!r}")
        if "schedule" in option_fields:
            raise TypeError(
                f"{type(self).__name__} runs schedule {self.schedule_name!r}; "
                "schedule is not an option here"
            )
        options = RunOptions.of(
            options,
            schedule=self.schedule_name,
            micro_batch_num=micro_batch_num,
            **option_fields,
        )
        if options.device is None:
            options = RunOptions.of(options, device=self.stages[0].default_copy_engine())
        self.options = options
        self.loss_fn = loss_fn

    @property
    def micro_batch_num(self) -> int:
        return self.options.micro_batch_num

    @property
    def swap(self) -> bool:
        return self.options.swap

    @property
    def device(self) -> Any:
        """The copy engine every run of this schedule uses (host buffers pooled)."""
        return self.options.device

    async def run_async(
        self, inputs: Any, targets: Any = None, *, trace: str | Path | None = None
    ) -> RunResult:
        """One training step over the whole batch ``inputs`` (split into micro-batches)."""
        return await run_schedule(
            self.stages,
            inputs=inputs,
            targets=targets,
            loss_fn=self.loss_fn,
            trace=trace,
            options=self.options,
        )

    def run(
        self, inputs: Any, targets: Any = None, *, trace: str | Path | None = None
    ) -> RunResult:
        """Synchronous ``run_async`` for scripts (not from inside a running event loop)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return anyio.run(self._run_for_sync, inputs, targets, trace)
        raise RuntimeError(
            "Schedule.run() was called inside a running event loop; use "
            "'await schedule.run_async(...)' there"
        )

    async def _run_for_sync(self, inputs: Any, targets: Any, trace: str | Path | None) -> RunResult:
        return await self.run_async(inputs, targets, trace=trace)


class ScheduleGPipe(_PipelineSchedule):
    """All forwards in micro-batch order, then all backwards."""

    schedule_name = "gpipe"


class Schedule1F1B(_PipelineSchedule):
    """PipeDream-flush / Megatron non-interleaved one-forward-one-backward."""

    schedule_name = "1f1b"


class ScheduleInterleaved1F1B(_PipelineSchedule):
    """Megatron-LM interleaved 1F1B over ``stage_num // pp`` virtual stages per rank."""

    schedule_name = "interleaved_1f1b"
