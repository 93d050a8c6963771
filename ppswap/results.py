"""What a run returns: ``RunResult`` and one ``RankStats`` per rank (a leaf module).

Every figure is measured, never taken from the plan: saved bytes from the storages the
swap layer holds, parameter bytes from the parameters' storages, times from clocks on
the threads that did the work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ChunkBytes", "RankStats", "RunResult"]


@dataclass(frozen=True, slots=True)
class ChunkBytes:
    """What one chunk ``(stage, micro)`` kept on device, measured from the swap layer's
    accounting of its own storages: ``held`` right after its FWD (a recomputed chunk: its
    non-recomputed saved tensors and its recomputed blocks' inputs), ``moved`` what its
    offload released (None: not swapped), ``regenerated`` what its RECOMPUTE added (None:
    not recomputed). ``CostModel.from_result`` plans a memory budget from them."""

    held: int
    moved: int | None = None
    regenerated: int | None = None


@dataclass(frozen=True, slots=True)
class RankStats:
    """What one rank measured during a run.

    ``peak_saved_bytes``: the peak of the device bytes of saved activations held for
    backward (0 with ``count_saved_bytes=False`` on a rank whose plan swaps nothing);
    ``offloaded_bytes`` / ``loaded_bytes``: what swap moved; ``exposed_copy_wait_s``: the
    time compute waited at SWAP_WAIT_* (copy time not hidden behind compute); ``copies``
    / ``copy_busy_s``: the copy stream's jobs and busy time;
    ``groups_left`` / ``saved_bytes_left``: what the swap layer still held after the run
    (0 unless a bug). Parameter bytes of the rank's stages, measured from their storages:
    at the peak and at the end of the run (between uses: the shards under FSDP), and
    unsharded. ``compute_job_s`` / ``compute_jobs``: seconds and count of the rank's
    compute-thread work by kind ("forward", "backward", "backward_input",
    "backward_weight", "swap_prepare", "swap_finish"), timed on the thread: what a
    ``CostModel``'s leaf_s, backward_leaf_s and swap_step_s are measured from;
    ``compute_batches``: the compute-thread jobs (hops) those steps took.
    ``device_peak_bytes``: the framework allocator's peak on the stages' device during
    the run, where it reports one (torch on CUDA), else 0. ``chunk_policy``: the plan's
    policy of each chunk ``(stage, micro)`` of the rank: ``"keep"``, ``"swap"``,
    ``"recompute"`` or ``"recompute+swap"`` (``ppswap.scheduler.recompute_plan``).
    ``chunk_bytes``: what each chunk of the rank kept, moved and regenerated
    (:class:`ChunkBytes`; empty where nothing is counted). ``predicted_peak_saved_bytes``
    / ``predicted_step_s``: under ``memory_budget``, the planner's prediction of
    ``peak_saved_bytes`` and of the step time (``ppswap.scheduler.budget``), else 0.
    ``aux_loss``: the load-balancing loss of the rank's MoE blocks (``aux_loss_coef``):
    each block's term, mean over the micro-batches, summed over the blocks (not scaled
    by ``loss_scale``, like the losses); 0.0 without such a block.
    """

    rank: int
    peak_saved_bytes: int
    offloaded_bytes: int
    loaded_bytes: int
    exposed_copy_wait_s: float
    steps_executed: int
    copies: int
    copy_busy_s: float
    groups_left: int = 0
    saved_bytes_left: int = 0
    peak_param_bytes: int = 0
    resident_param_bytes: int = 0
    unsharded_param_bytes: int = 0
    compute_job_s: Mapping[str, float] = field(default_factory=dict)
    compute_jobs: Mapping[str, int] = field(default_factory=dict)
    compute_batches: int = 0
    device_peak_bytes: int = 0
    chunk_policy: Mapping[tuple[int, int], str] = field(default_factory=dict)
    chunk_bytes: Mapping[tuple[int, int], ChunkBytes] = field(default_factory=dict)
    predicted_peak_saved_bytes: int = 0
    predicted_step_s: float = 0.0
    aux_loss: float = 0.0


@dataclass(frozen=True, slots=True)
class RunResult:
    """The outcome of one run.

    ``losses`` has one float per micro-batch (the last stage's), ``loss`` their mean,
    ``ranks`` is indexed by rank, ``trace_path`` is where the Chrome trace went (if asked).
    With FSDP (a DP x PP mesh) ``losses[m]`` is the mean over dp replicas of their
    micro-batch ``m`` (equal-sized, so the mean loss of the global micro-batch) and
    ``ranks`` is indexed by world rank (``dp_index * pp + pp_index``).

    ``outputs``: in a forward-only run without ``loss_fn``, the last stage's output for
    each micro-batch (a host array, or a tuple of them), in batch order (with FSDP: every
    replica's micro-batches, replica after replica), and no losses; only where the last
    stage runs (in this process), empty elsewhere and in every other run.
    """

    losses: list[float]
    loss: float
    ranks: list[RankStats]
    generation: int
    step_time_s: float
    trace_path: Path | None = None
    swap: bool = False
    schedule: str = ""
    extras: dict[str, Any] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)
