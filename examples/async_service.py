"""Embedding ppswap in an async service: progress events, per-rank metrics, cancellation.

Needs MindSpore (``pip install -e '.[mindspore]'``); without it, it exits with one line
saying so. For an HTTP service, ``ppswap serve`` (the ``serve`` extra) is the real one:
Starlette under uvicorn, jobs in SQLite, server-sent events, Prometheus metrics.

    python examples/async_service.py              # train 3 steps, print what happens
    python examples/async_service.py --self-test  # also cancel a step mid-run, then check

A trainer task runs one ``run_schedule`` per step (then an SGD step) and hands the run a
``ppswap.RunEvents``; a watcher task consumes it as the run goes (chunks offloaded and
loaded, each rank done, the run finished or cancelled), without ever slowing the run. A
``LoopLagMonitor`` says how long the event loop was kept from answering, and
``rank_metrics`` turns each result into one flat snapshot per rank, what an exporter
publishes. The self-test cancels a step at its first offload: the runtime tears the run
down (no thread, no swap group left), no optimizer step happens, and the step run again
gives exactly the loss of an uninterrupted training.
"""

from __future__ import annotations

import argparse
import sys
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from ppswap import LoopLagMonitor, PipelineStage, RunEvents, rank_metrics, run_schedule
from ppswap.events import ChunkOffloaded, RunCancelled, RunFinished
from ppswap.swap import EmulatedDevice, swap_wrapper

try:
    from ppswap.demo.model import build_mlp_stages, mse_loss
except ModuleNotFoundError as missing:
    if missing.name != "mindspore":
        raise
    sys.exit(
        "examples/async_service.py runs on MindSpore, which is not installed: "
        "pip install -e '.[mindspore]' in the ppswap checkout"
    )

STEPS, LR = 3, 0.05


def make_stages() -> list[PipelineStage]:
    modules = build_mlp_stages(4, dim=32, wrap=swap_wrapper)
    return [PipelineStage(module, index, 4) for index, module in enumerate(modules)]


def make_batches() -> list[tuple[Any, Any]]:
    rng = np.random.default_rng(0)
    arrays = rng.standard_normal((STEPS, 2, 16, 32)).astype(np.float32)
    return [(x, y) for x, y in arrays]


async def train_step(stages: list[PipelineStage], batch: Any, events: RunEvents | None) -> float:
    x, y = batch
    options = {"micro_batch_num": 8, "swap": True, "device": EmulatedDevice()}
    result = await run_schedule(
        stages, "1f1b", inputs=x, targets=y, loss_fn=mse_loss, events=events, **options
    )
    for stage in stages:  # SGD
        for param, grad in zip(stage.parameters, stage.grads, strict=True):
            param.set_data(param - LR * grad)
    return result.loss


@dataclass
class Steering:
    """What the watcher may cancel: the step in flight, at its first offload if asked."""

    step_scope: anyio.CancelScope | None = None
    cancel_at_offload: bool = False


async def watch(events: RunEvents, seen: list[str], steering: Steering) -> None:
    async for event in events:
        seen.append(type(event).__name__)
        if isinstance(event, ChunkOffloaded) and steering.cancel_at_offload:
            steering.cancel_at_offload = False
            assert steering.step_scope is not None
            steering.step_scope.cancel()  # inside the step, between its swap steps
        elif isinstance(event, RunFinished):
            print(f"run {event.generation}: loss {event.result.loss:.6f}")
            for metrics in rank_metrics(event.result):
                print(f"  {metrics}")
        elif isinstance(event, RunCancelled):
            print(f"run {event.generation}: cancelled and torn down")


async def train(cancel_step: int | None) -> tuple[list[float], list[str], float]:
    """Train ``STEPS`` steps (cancelling step ``cancel_step`` once at its first offload,
    then running it again); the losses, the names of the events seen, the loop's largest
    lag."""
    stages, batches = make_stages(), make_batches()
    losses: list[float] = []
    seen: list[str] = []
    steering = Steering()
    async with LoopLagMonitor() as lag, anyio.create_task_group() as tg:
        events = RunEvents()
        tg.start_soon(watch, events, seen, steering)
        while len(losses) < STEPS:
            with anyio.CancelScope() as steering.step_scope:
                if len(losses) == cancel_step:
                    steering.cancel_at_offload, cancel_step = True, None  # once
                losses.append(await train_step(stages, batches[len(losses)], events))
        events.close()  # the watcher ends once it has seen every event
    return losses, seen, lag.max_s


def ppswap_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("ppswap-")]


async def main(self_test: bool) -> None:
    losses, seen, lag_s = await train(cancel_step=None)
    print(f"losses {losses}; events seen {len(seen)}; loop lag at most {lag_s * 1e3:.1f} ms")
    if not self_test:
        return
    again, seen_again, _ = await train(cancel_step=1)
    assert "RunCancelled" in seen_again and seen_again.count("RunFinished") == STEPS, seen_again
    assert again == losses, f"a cancelled step changed the training: {again} != {losses}"
    assert ppswap_threads() == [], ppswap_threads()
    print("self-test passed: a cancelled step left no trace; the losses are the same")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--self-test", action="store_true")
    anyio.run(main, parser.parse_args().self_test)
