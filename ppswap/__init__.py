"""ppswap: pipeline-parallel activation swap on MindSpore, as an asyncio actor runtime.

Users mark what may move (``ppswap.swap.swap_wrapper`` / ``swap_tensor_wrapper``); the
pipeline scheduler decides when it moves (``swap=True``).
"""

from ppswap.actors.runtime import RankStats, RunResult, run_schedule
from ppswap.errors import PipelineError, PipelineHangError, PipelineInputError
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.logs import configure_logging
from ppswap.pipeline import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import MetaStep, StepKind
from ppswap.stage import PipelineStage

__all__ = [
    "DeviceMesh",
    "MetaStep",
    "PipelineError",
    "PipelineHangError",
    "PipelineInputError",
    "PipelineStage",
    "RankStats",
    "RunResult",
    "Schedule1F1B",
    "ScheduleConfig",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "StepKind",
    "configure_logging",
    "fully_shard",
    "run_schedule",
]
