"""ppswap: pipeline-parallel activation swap on MindSpore."""

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import MetaStep, StepKind

__all__ = ["MetaStep", "ScheduleConfig", "StepKind"]
