"""The time model of the cost-aware swap policy and the memory budget: :class:`CostModel`,
a few measured numbers (a compute leaf's seconds, a chunk's copy seconds, the P2P
latency, the shared thread's swap-step cost) that ``ppswap.scheduler.cost_simulation``
turns into a simulated step.

Nothing here imports MindSpore or anyio; every function is pure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.cost_calibration import StageBytes, calibrated_fields
from ppswap.scheduler.steps import (
    StepKind,
)

__all__ = ["DEFAULT_COST_BUDGET", "CostModel", "StageBytes"]

DEFAULT_COST_BUDGET = 0.02
"""The default exposed-wait budget: 2% of the step time, per rank."""


def _check_number(name: str, value: Any, *, allow_inf: bool, allow_zero: bool) -> float:
    allowed = (
        f"a number {'>= 0' if allow_zero else '> 0'}"
        f"{' (math.inf allowed)' if allow_inf else ', finite'}"
    )
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
    number = float(value)
    if (
        math.isnan(number)
        or number < 0
        or (number == 0 and not allow_zero)
        or (math.isinf(number) and not allow_inf)
    ):
        raise ValueError(f"{name} must be {allowed}, got {value!r}")
    return number


def _check_chunk_bytes(value: Any) -> None:
    allowed = "an int >= 0 or a non-empty tuple of ints >= 0 (one per global stage)"
    items = value if isinstance(value, tuple) else (value,)
    if isinstance(value, tuple) and not value:
        raise ValueError(f"chunk_bytes must be {allowed}, got {value!r}")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int):
            raise TypeError(f"chunk_bytes must be {allowed}, got {value!r}")
        if item < 0:
            raise ValueError(f"chunk_bytes must be {allowed}, got {value!r}")


@dataclass(frozen=True, slots=True)
class CostModel:
    """What the cost policy knows about copies and compute.

    ``chunk_bytes``: bytes one chunk moves each way, one int for every stage or a tuple
    indexed by global stage. ``d2h_gbps`` / ``h2d_gbps``: copy bandwidth in GB/s (1e9
    bytes/s, as ``EmulatedDevice``); ``math.inf`` is a free copy, ``0`` a copy that never
    ends. ``leaf_s``: wall time of one compute leaf (a FWD, and any leaf when
    ``backward_leaf_s`` is None). ``backward_leaf_s``: wall time of one BWD leaf; a split
    backward's BWD_INPUT and BWD_WEIGHT take half of it each (a backward usually costs more
    than a forward, up to twice as much, and the loads land in the backward phase, where
    that difference decides whether a copy hides). ``headroom``: the share of the budget the
    policy lets the *predicted* exposed wait use, in ``[0, 1]``; below 1 it keeps the rest
    for the model's error (on a shared machine the measured wait of one plan varies by a few
    points of the step from run to run). ``p2p_latency_s``: from a leaf's end to the start
    of the leaf on another rank that needs its result (the activation or gradient must
    travel); it decides who comes first at the shared compute thread, where a rank that
    needs nothing from another rank otherwise ties with one that does. ``budget``: the
    exposed wait allowed per rank, a share of the step time in ``[0, 1]`` (0.02 = 2%).
    ``copy_overhead_s``: a fixed cost per copy on top of ``bytes / bandwidth``.
    ``shared_compute``: all ranks share one compute thread (the in-process runtime); False
    is one device per rank. ``swap_step_s``: with ``shared_compute``, the compute-thread
    time of each swap step's own job (preparing a copy, finishing one); 0 still queues the
    job behind the compute already requested, which is what delays a copy's start there.
    ``split_directions``: offloads and loads run on separate copy streams (the runtime's
    default, ``CopyStream(split_directions=True)``); False is one stream for both.

    Measure them on the target: ``leaf_s`` and ``backward_leaf_s`` from a swap run's
    ``RankStats.compute_job_s`` / ``compute_jobs`` (``"forward"``, ``"backward"``), or
    ``leaf_s`` alone as its step time divided by its compute leaves; ``swap_step_s`` from
    the same run's ``"swap_prepare"`` / ``"swap_finish"`` jobs; ``chunk_bytes`` as
    ``RankStats.offloaded_bytes`` per offloaded chunk; ``copy_overhead_s`` as the
    ``copy_busy_s / copies`` of a run at the target bandwidth minus ``bytes / bandwidth``.

    For a memory budget (``ppswap.scheduler.budget``): ``stage_bytes``, one
    :class:`StageBytes` per global stage (the bytes a chunk keeps, moves, holds recomputed
    and regenerates), and ``recompute_leaf_s``, the compute time of one RECOMPUTE step
    (None: ``leaf_s``, a forward's). :meth:`from_result` measures all of them from earlier
    steps of the same stages.
    """

    chunk_bytes: int | tuple[int, ...]
    d2h_gbps: float
    h2d_gbps: float
    leaf_s: float
    budget: float = DEFAULT_COST_BUDGET
    copy_overhead_s: float = 0.0
    shared_compute: bool = False
    swap_step_s: float = 0.0
    backward_leaf_s: float | None = None
    headroom: float = 1.0
    p2p_latency_s: float = 0.0
    stage_bytes: tuple[StageBytes, ...] | None = None
    recompute_leaf_s: float | None = None
    split_directions: bool = True

    @classmethod
    def from_result(
        cls,
        result: Any,
        *more: Any,
        copy_gbps: float | None = None,
        shared_compute: bool = True,
        **changes: Any,
    ) -> CostModel:
        """A model measured from ``result`` (and ``more`` results of the same stages):
        chunk bytes per stage and policy, compute times per leaf, the copy bandwidth
        (``ppswap.scheduler.cost_calibration`` says which figure comes from where).
        ``copy_gbps``: plan with this bandwidth instead of the measured one;
        ``shared_compute``: the ranks share one compute thread (the in-process runtime);
        ``changes``: any other field (``budget``, ``headroom`` ...)."""
        results = (result, *more)
        stages = [chunk[0] for r in results for rank in r.ranks for chunk in rank.chunk_bytes]
        fields = calibrated_fields(
            results,
            num_stages=max(stages, default=-1) + 1,
            copy_gbps=copy_gbps,
            shared_compute=shared_compute,
        )
        fields.update(changes)
        return cls(**fields)

    def __post_init__(self) -> None:
        _check_chunk_bytes(self.chunk_bytes)
        _check_number("d2h_gbps", self.d2h_gbps, allow_inf=True, allow_zero=True)
        _check_number("h2d_gbps", self.h2d_gbps, allow_inf=True, allow_zero=True)
        _check_number("leaf_s", self.leaf_s, allow_inf=False, allow_zero=False)
        budget = _check_number("budget", self.budget, allow_inf=False, allow_zero=True)
        if budget > 1:
            raise ValueError(
                f"budget must be a share of the step time in [0, 1] (0.02 = 2%), got "
                f"{self.budget!r}"
            )
        _check_number("copy_overhead_s", self.copy_overhead_s, allow_inf=False, allow_zero=True)
        if not isinstance(self.shared_compute, bool):
            raise TypeError(f"shared_compute must be a bool, got {self.shared_compute!r}")
        if not isinstance(self.split_directions, bool):
            raise TypeError(f"split_directions must be a bool, got {self.split_directions!r}")
        _check_number("swap_step_s", self.swap_step_s, allow_inf=False, allow_zero=True)
        headroom = _check_number("headroom", self.headroom, allow_inf=False, allow_zero=True)
        if headroom > 1:
            raise ValueError(f"headroom must be a share in [0, 1], got {self.headroom!r}")
        _check_number("p2p_latency_s", self.p2p_latency_s, allow_inf=False, allow_zero=True)
        if self.backward_leaf_s is not None:
            _check_number(
                "backward_leaf_s", self.backward_leaf_s, allow_inf=False, allow_zero=False
            )
        if self.recompute_leaf_s is not None:
            _check_number(
                "recompute_leaf_s", self.recompute_leaf_s, allow_inf=False, allow_zero=True
            )
        if self.stage_bytes is not None and not (
            isinstance(self.stage_bytes, tuple)
            and all(isinstance(item, StageBytes) for item in self.stage_bytes)
        ):
            raise TypeError(
                f"stage_bytes must be a tuple of StageBytes (one per global stage) or None, "
                f"got {self.stage_bytes!r}"
            )

    @property
    def recompute_s(self) -> float:
        """Compute time of one RECOMPUTE step."""
        return self.leaf_s if self.recompute_leaf_s is None else self.recompute_leaf_s

    def leaf_time(self, kind: StepKind) -> float:
        """Compute time of one leaf of ``kind`` (FWD, BWD, BWD_INPUT or BWD_WEIGHT)."""
        if self.backward_leaf_s is None or kind is StepKind.FWD:
            return self.leaf_s
        if kind is StepKind.BWD:
            return self.backward_leaf_s
        return self.backward_leaf_s / 2

    def bytes_of(self, stage: int) -> int:
        """Bytes one chunk of global stage ``stage`` moves in each direction."""
        if isinstance(self.chunk_bytes, int):
            return self.chunk_bytes
        return self.chunk_bytes[stage]

    def copy_s(self, kind: StepKind, stage: int) -> float:
        """Copy-stream time of one chunk's offload (LAUNCH_OFFLOAD) or load (LAUNCH_LOAD)."""
        gbps = self.d2h_gbps if kind is StepKind.SWAP_LAUNCH_OFFLOAD else self.h2d_gbps
        nbytes = self.bytes_of(stage)
        if nbytes == 0 or math.isinf(gbps):
            return self.copy_overhead_s
        if gbps == 0:
            return math.inf
        return self.copy_overhead_s + nbytes / (gbps * 1e9)

    def check_for(self, config: ScheduleConfig) -> None:
        """ValueError when ``chunk_bytes`` is a tuple of the wrong length for ``config``."""
        if isinstance(self.chunk_bytes, tuple) and len(self.chunk_bytes) != config.num_stages:
            raise ValueError(
                f"cost.chunk_bytes must hold one entry per global stage ({config.num_stages} "
                f"for pp={config.pp}, vpp={config.vpp}), got {len(self.chunk_bytes)}"
            )
        if self.stage_bytes is not None and len(self.stage_bytes) != config.num_stages:
            raise ValueError(
                f"cost.stage_bytes must hold one entry per global stage ({config.num_stages} "
                f"for pp={config.pp}, vpp={config.vpp}), got {len(self.stage_bytes)}"
            )
