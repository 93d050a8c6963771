"""Schedule classes: a schedule family bound to its stages and options, run many times.

``ScheduleGPipe(stages, micro_batch_num=8, swap=True)`` checks its options at once (bad
input fails at construction, before any work), owns the copy engine (so host buffers are
pooled across runs) and runs with ``await schedule.run_async(x, targets=y)`` or, from
synchronous code, ``schedule.run(x, targets=y)``. ``swap_policy="cost"`` with
``cost_model=CostModel(...)`` (``ppswap.scheduler.cost``) chooses the swapped chunks by
their copy cost instead of the fixed gap rule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import anyio

from ppswap.actors.p2p import Transport
from ppswap.actors.runtime import DEFAULT_STEP_TIMEOUT_S, RunResult, run_schedule
from ppswap.backends.base import CopyEngine
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import CostModel, SwapPolicy, check_swap_policy
from ppswap.stage import LossFn, PipelineStage

__all__ = ["Schedule1F1B", "ScheduleGPipe", "ScheduleInterleaved1F1B"]


class _PipelineSchedule:
    schedule_name: ClassVar[str]

    def __init__(
        self,
        stages: PipelineStage | Sequence[PipelineStage],
        micro_batch_num: int,
        *,
        loss_fn: LossFn | None = None,
        swap: bool = False,
        pp: int | None = None,
        split_dw: bool = False,
        overlap_b_f: bool = False,
        p2p: str = "plain",
        min_swap_gap: int = 4,
        step_timeout: float = DEFAULT_STEP_TIMEOUT_S,
        transport: Transport | None = None,
        device: CopyEngine | None = None,
        swap_policy: SwapPolicy = "gap",
        cost_model: CostModel | None = None,
    ) -> None:
        self.stages: list[PipelineStage] = (
            [stages] if isinstance(stages, PipelineStage) else list(stages)
        )
        if not self.stages or not all(isinstance(s, PipelineStage) for s in self.stages):
            raise TypeError(f"stages must be PipelineStage objects, got {stages!r}")
        stage_num = self.stages[0].stage_num
        resolved_pp = pp if pp is not None else getattr(transport, "world_size", stage_num)
        if self.schedule_name == "interleaved_1f1b" and pp is None and transport is None:
            raise ValueError("pp must be given for ScheduleInterleaved1F1B, got pp=None")
        if not isinstance(resolved_pp, int) or resolved_pp < 1 or stage_num % resolved_pp:
            raise ValueError(f"pp must be an int >= 1 dividing stage_num={stage_num}, got {pp!r}")
        # Checks every option now, with the same messages the run would give.
        ScheduleConfig(
            schedule=self.schedule_name,  # type: ignore[arg-type]
            pp=resolved_pp,
            vpp=stage_num // resolved_pp,
            micro=micro_batch_num,
            split_dw=split_dw,
            overlap_b_f=overlap_b_f,
            p2p=p2p,  # type: ignore[arg-type]
            swap=swap,
            min_swap_gap=min_swap_gap,
        )
        check_swap_policy(swap_policy, cost_model)
        self.micro_batch_num = micro_batch_num
        self.loss_fn = loss_fn
        self.swap = swap
        self.pp = pp
        self.split_dw = split_dw
        self.overlap_b_f = overlap_b_f
        self.p2p = p2p
        self.min_swap_gap = min_swap_gap
        self.swap_policy: SwapPolicy = swap_policy
        self.cost_model = cost_model
        self.step_timeout = step_timeout
        self.transport = transport
        self.device: CopyEngine = (
            device if device is not None else self.stages[0].backend.copy_engine()
        )

    async def run_async(
        self, inputs: Any, targets: Any = None, *, trace: str | Path | None = None
    ) -> RunResult:
        """One training step over the whole batch ``inputs`` (split into micro-batches)."""
        return await run_schedule(
            self.stages,
            self.schedule_name,
            micro_batch_num=self.micro_batch_num,
            inputs=inputs,
            targets=targets,
            loss_fn=self.loss_fn,
            swap=self.swap,
            pp=self.pp,
            split_dw=self.split_dw,
            overlap_b_f=self.overlap_b_f,
            p2p=self.p2p,
            min_swap_gap=self.min_swap_gap,
            step_timeout=self.step_timeout,
            transport=self.transport,
            device=self.device,
            trace=trace,
            swap_policy=self.swap_policy,
            cost_model=self.cost_model,
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
