"""ppswap: pipeline-parallel activation swap, as an asyncio actor runtime.

Users mark what may move (``ppswap.swap.swap_wrapper`` / ``swap_tensor_wrapper``); the
pipeline scheduler decides when it moves (``swap=True``). Stages are MindSpore cells or
torch modules (``ppswap.backends``); importing ppswap imports neither framework.
"""

from ppswap.actors.runtime import run_schedule
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.errors import PipelineError, PipelineHangError, PipelineInputError
from ppswap.events import RunEvents
from ppswap.fsdp import DeviceMesh, fully_shard
from ppswap.logs import configure_logging
from ppswap.metrics import LoopLagMonitor, RankMetrics, rank_metrics
from ppswap.moe import expert_parallel
from ppswap.options import RunOptions
from ppswap.pipeline import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from ppswap.results import RankStats, RunResult
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import MetaStep, StepKind
from ppswap.stage import PipelineStage
from ppswap.swap.errors import SwapWarning
from ppswap.swap.recompute import recompute_wrapper

__all__ = [
    "DeviceMesh",
    "EmulatedDevice",
    "LoopLagMonitor",
    "MetaStep",
    "PipelineError",
    "PipelineHangError",
    "PipelineInputError",
    "PipelineStage",
    "RankMetrics",
    "RankStats",
    "RunEvents",
    "RunOptions",
    "RunResult",
    "Schedule1F1B",
    "ScheduleConfig",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "StepKind",
    "SwapWarning",
    "configure_logging",
    "expert_parallel",
    "fully_shard",
    "rank_metrics",
    "recompute_wrapper",
    "run_schedule",
]
