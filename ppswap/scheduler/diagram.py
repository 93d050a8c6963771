"""The schedule diagram, loaded only when one is drawn.

``ppswap.scheduler.plot`` imports matplotlib, which takes about a second; ``ppswap plan``
and a demo run without a diagram should not pay for it. ``load_plotter()`` imports the
plot module by name at the moment a diagram is wanted and returns its ``plot_schedule``,
or None when matplotlib is not installed (the optional 'plot' extra).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Protocol

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost import CostModel, SwapPolicy

__all__ = ["PLOT_MODULE", "Plotter", "load_plotter"]

PLOT_MODULE = "ppswap.scheduler.plot"


class Plotter(Protocol):
    """``plot.plot_schedule``: draws ``config``'s diagram (with swap, the chunks of
    ``swap_policy``) to ``path`` and returns it."""

    def __call__(
        self,
        config: ScheduleConfig,
        path: str | Path,
        *,
        swap_policy: SwapPolicy = "gap",
        cost_model: CostModel | None = None,
    ) -> Path: ...


def load_plotter() -> Plotter | None:
    """``plot_schedule(config, path, swap_policy=..., cost_model=...) -> path``, or None
    without matplotlib."""
    try:
        module = importlib.import_module(PLOT_MODULE)
    except ImportError:
        return None
    plotter: Plotter = module.plot_schedule
    return plotter
