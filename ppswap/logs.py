"""Opt-in logging set-up for scripts. The library itself never configures logging."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from ppswap.scheduler.steps import MetaStep

__all__ = ["configure_logging", "log_step"]


def log_step(log: Any, event: str, step: MetaStep, generation: int, **fields: Any) -> None:
    """One debug event about ``step``, with the fields every step event carries."""
    log.debug(
        event,
        step=step.kind.value,
        stage=step.stage,
        micro=step.micro,
        generation=generation,
        **fields,
    )


def configure_logging(*, json: bool = False, level: int | str = logging.INFO) -> None:
    """Configure structlog for a script: key-value (or JSON) lines on stderr.

    Once structlog is configured, the runtime also emits one debug event per MetaStep
    (with ``rank``, ``actor``, ``step``, ``stage``, ``micro``, ``generation``); pass
    ``level="DEBUG"`` to see them.
    """
    numeric = logging.getLevelName(level) if isinstance(level, str) else level
    if not isinstance(numeric, int):
        raise ValueError(f"level must be a logging level name or number, got {level!r}")
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
