"""Shared helpers of the reliability tests: small pipelines, a reference, leak probes.

The reference gradients of a configuration come from a run on *fresh* stages built from
the same seed (``build_mlp_stages`` seeds MindSpore and numpy): gradients depend only on
the weights and the data, so a run on stages that failed or were cancelled before must
give exactly these (``test_cancellation`` also checks once that they equal the gradients
of a fresh process).
"""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import psutil
from stage_runs import stage_runs_holding_chunks

from ppswap import PipelineError, PipelineHangError, PipelineStage, RunResult, run_schedule
from ppswap.demo.model import build_mlp_stages, mse_loss
from ppswap.swap import EmulatedDevice, PipelineSwapSession, SwapGroup, swap_wrapper
from ppswap.swap.entries import GroupPhase

DIM = 8
BATCH = 8


@dataclass(frozen=True)
class Case:
    """A small pipeline configuration."""

    schedule: str = "gpipe"
    pp: int = 2
    stage_num: int = 2
    micro: int = 4
    swap: bool = True
    split_dw: bool = False
    overlap_b_f: bool = False
    p2p: str = "plain"

    def kwargs(self) -> dict[str, Any]:
        return {
            "micro_batch_num": self.micro,
            "loss_fn": mse_loss,
            "swap": self.swap,
            "pp": self.pp,
            "split_dw": self.split_dw,
            "overlap_b_f": self.overlap_b_f,
            "p2p": self.p2p,
        }


GPIPE = Case()
ONE_F_ONE_B = Case(schedule="1f1b", pp=2, stage_num=2, micro=4)
INTERLEAVED = Case(schedule="interleaved_1f1b", pp=2, stage_num=4, micro=4, split_dw=True)


def make_stages(stage_num: int, *, dim: int = DIM, seed: int = 0) -> list[PipelineStage]:
    modules = build_mlp_stages(stage_num, dim=dim, wrap=swap_wrapper, seed=seed)
    return [PipelineStage(m, i, stage_num) for i, m in enumerate(modules)]


def make_data(batch: int = BATCH, dim: int = DIM, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, dim)).astype(np.float32)
    y = rng.standard_normal((batch, dim)).astype(np.float32)
    return x, y


def grads_of(stages: list[PipelineStage]) -> list[np.ndarray]:
    return [g.asnumpy() for stage in stages for g in stage.grads]


async def run_case(stages: list[PipelineStage], case: Case, **overrides: Any) -> RunResult:
    x, y = make_data()
    kwargs = case.kwargs() | {"inputs": x, "targets": y, "step_timeout": 30.0} | overrides
    return await run_schedule(stages, case.schedule, **kwargs)


@dataclass(frozen=True)
class Failure:
    """What a failed run raised, without the exception (its traceback pins the run's frames,
    so a test that keeps it would see the run's objects alive)."""

    error_type: type[BaseException]
    rank: int | None
    actor: str | None
    step: str | None
    message: str
    cause_type: type[BaseException] | None
    cause_message: str
    dump: str | None


async def failure_of(run: Awaitable[Any]) -> Failure:
    """Await ``run``, which must raise a PipelineError; describe it."""
    try:
        await run
    except PipelineError as error:
        cause = error.__cause__
        return Failure(
            error_type=type(error),
            rank=error.rank,
            actor=error.actor,
            step=error.step,
            message=str(error),
            cause_type=None if cause is None else type(cause),
            cause_message="" if cause is None else str(cause),
            dump=error.dump if isinstance(error, PipelineHangError) else None,
        )
    raise AssertionError("the run did not fail")


_REFERENCE: dict[Case, tuple[list[float], list[np.ndarray]]] = {}


async def reference(case: Case) -> tuple[list[float], list[np.ndarray]]:
    """Losses and gradients of ``case`` on fresh stages (computed once per process)."""
    if case not in _REFERENCE:
        stages = make_stages(case.stage_num)
        result = await run_case(stages, case)
        _REFERENCE[case] = (result.losses, grads_of(stages))
    return _REFERENCE[case]


def assert_same_grads(expected: list[np.ndarray], actual: list[np.ndarray]) -> None:
    assert len(expected) == len(actual)
    for e, a in zip(expected, actual, strict=True):
        np.testing.assert_array_equal(e, a)  # bit-identical


def ppswap_threads() -> list[str]:
    """The live ppswap threads, but for a TorchDistTransport's waiting thread, which may
    outlive its transport in gloo (docs/torch_dist.md, Limits): another test's, never a
    run's here (as torch_support.assert_clean counts them)."""
    names = (t.name for t in threading.enumerate() if t.name.startswith("ppswap-"))
    return sorted(name for name in names if name != "ppswap-torch-dist-wait")


def swap_object_counts() -> tuple[int, int]:
    """(SwapGroup, PipelineSwapSession) objects alive in the process, released or not.

    MindSpore may keep the saved-tensor hook of a recent forward (and, through it, a
    finished session) alive for a while: a few such objects are not a leak, a count that
    grows with the runs is.
    """
    gc.collect()
    groups = sessions = 0
    for obj in gc.get_objects():
        kind = type(obj)  # not isinstance: that dereferences dead weak proxies
        if kind is SwapGroup:
            groups += 1
        elif kind is PipelineSwapSession:
            sessions += 1
    return groups, sessions


def live_swap_objects() -> tuple[int, int]:
    """(groups not released, sessions still holding chunks) in the process: what a run
    must never leave behind."""
    gc.collect()
    groups = sessions = 0
    for obj in gc.get_objects():
        kind = type(obj)
        if kind is SwapGroup and obj.phase is not GroupPhase.RELEASED:
            groups += 1
        elif kind is PipelineSwapSession and obj.stats().live_chunks:
            sessions += 1
    return groups, sessions


def other_tasks() -> set[asyncio.Task[Any]]:
    """Tasks of the running loop other than the caller's."""
    current = asyncio.current_task()
    return {t for t in asyncio.all_tasks() if t is not current and not t.done()}


def rss_bytes() -> int:
    return int(psutil.Process().memory_info().rss)


def assert_clean(
    stages: list[PipelineStage], device: EmulatedDevice, baseline: tuple[int, int] = (0, 0)
) -> None:
    """Nothing of a finished (failed, cancelled or successful) run is left behind.

    ``baseline``: the swap objects alive before the run (other tests' fixtures).
    """
    assert ppswap_threads() == []
    assert other_tasks() == set()
    assert live_swap_objects() == baseline
    assert stage_runs_holding_chunks() == 0
    pool = device.pool_stats()
    assert pool.lent == 0 and pool.bytes_lent == 0


def run_in_fresh_loop(fn: Callable[[], Awaitable[Any]]) -> Any:
    """Run ``fn`` in a new asyncio event loop (hypothesis tests are synchronous)."""
    return anyio.run(fn, backend="asyncio")


__all__ = [
    "BATCH",
    "DIM",
    "GPIPE",
    "INTERLEAVED",
    "ONE_F_ONE_B",
    "Case",
    "Failure",
    "assert_clean",
    "assert_same_grads",
    "failure_of",
    "grads_of",
    "live_swap_objects",
    "make_data",
    "make_stages",
    "other_tasks",
    "ppswap_threads",
    "reference",
    "rss_bytes",
    "run_case",
    "run_in_fresh_loop",
    "swap_object_counts",
]
