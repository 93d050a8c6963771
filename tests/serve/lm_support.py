"""A small demo LM (``ppswap.demo``) on either backend, for the event and metrics tests:
2 stages of one transformer block each, swap-wrapped, 4 micro-batches of real text."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from ppswap import PipelineStage, RunResult, run_schedule
from ppswap.demo.run import DemoModel, lm_batches, load_corpus, load_demo_model
from ppswap.events import RunEvents
from ppswap.swap import EmulatedDevice, swap_wrapper

BACKENDS = [pytest.param("mindspore", marks=pytest.mark.mindspore), "torch"]
SIZES = {"seq": 8, "dim": 16, "heads": 2, "layers_per_stage": 1}


@dataclass
class SmallLM:
    model: DemoModel
    stages: list[PipelineStage]
    batches: list[tuple[Any, Any]]

    async def run(
        self, step: int = 0, events: RunEvents | None = None, **options: Any
    ) -> RunResult:
        x, y = self.batches[step]
        kwargs: dict[str, Any] = {"micro_batch_num": 4, "swap": True, "step_timeout": 60.0}
        kwargs |= options
        return await run_schedule(
            self.stages,
            inputs=x,
            targets=y,
            loss_fn=self.model.loss_fn,
            device=EmulatedDevice(),
            events=events,
            **kwargs,
        )


def small_lm(backend: str, *, stage_num: int = 2, steps: int = 2) -> SmallLM:
    model = load_demo_model(backend)
    model.prepare()
    text = load_corpus()
    cfg = model.config(vocab=len(set(text)), **SIZES)
    modules = model.build_stages(cfg, stage_num)
    for module in modules:
        for index, layer in enumerate(module.layers):
            module.layers[index] = swap_wrapper(layer)
    stages = [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]
    return SmallLM(model, stages, lm_batches(text, cfg, 8, steps))
