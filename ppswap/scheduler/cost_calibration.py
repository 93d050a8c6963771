"""A CostModel from measured steps: the numbers ``CostModel.from_result`` reads.

What a run measured (``RunResult.ranks[r]``: ``chunk_bytes``, ``chunk_policy``,
``compute_job_s`` / ``compute_jobs``, ``copy_busy_s`` and the bytes the copies moved) is
turned into the fields of a :class:`~ppswap.scheduler.cost_model.CostModel`, so a
training loop or a service plans its next step (a memory budget, the cost policy) from
its last ones. The result is read by attribute (duck-typed), so the scheduler stays
free of the runtime.

Per global stage, :class:`StageBytes`, from the chunks that measured them (several steps:
the most conservative figure of all of them):

- ``kept``: the bytes a kept chunk holds: the largest ``held`` of a kept or swapped chunk
  (a swapped chunk holds everything until its offload); where only recomputed chunks
  were measured, their ``held + regenerated`` (at least what keeping holds: the blocks'
  inputs are counted on top of what they save);
- ``moved``: what a swap moves off device: the smallest ``moved`` of a swapped chunk
  (None where no chunk of the stage was swapped alone);
- ``recompute_held`` / ``regenerated``: what a recomputed chunk holds from its FWD to its
  RECOMPUTE, and what the RECOMPUTE adds back: the largest of the recomputed chunks' (None
  where no chunk of the stage was recomputed alone).

Times: ``leaf_s`` is the mean ``"forward"`` job, ``backward_leaf_s`` the mean
``"backward"`` (or twice the mean ``"backward_input"``), ``recompute_s`` the mean
``"recompute"`` job, ``swap_step_s`` the mean ``"swap_prepare"`` / ``"swap_finish"`` job,
over every rank. The copy bandwidth is the bytes moved over the copy stream's busy time
where the steps copied anything, else the given default. What a step did not measure
(no forward job: a run without stats) is taken from the defaults below.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_COPY_GBPS", "DEFAULT_LEAF_S", "StageBytes", "calibrated_fields"]

DEFAULT_LEAF_S = 1e-3
"""The compute time of a leaf where no step measured one (seconds)."""

DEFAULT_COPY_GBPS = 16.0
"""The copy bandwidth where no step copied anything (GB/s, each way): a PCIe 4 x16 link."""


@dataclass(frozen=True, slots=True)
class StageBytes:
    """The bytes of one chunk of a stage under each policy (module docstring); None where
    the policy was not measured on the stage (the budget planner then does not use it)."""

    kept: int
    moved: int | None = None
    recompute_held: int | None = None
    regenerated: int | None = None

    def __post_init__(self) -> None:
        for name in ("kept", "moved", "recompute_held", "regenerated"):
            value = getattr(self, name)
            if value is None and name != "kept":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"StageBytes.{name} must be an int >= 0, got {value!r}")

    @property
    def swap_held(self) -> int | None:
        """What a swapped chunk keeps on device while its saved tensors are on the host."""
        return None if self.moved is None else max(self.kept - self.moved, 0)


def _stage_bytes(results: Iterable[Any], num_stages: int) -> tuple[StageBytes, ...]:
    kept: dict[int, int] = {}
    recompute_kept: dict[int, int] = {}
    moved: dict[int, int] = {}
    held: dict[int, int] = {}
    regenerated: dict[int, int] = {}
    for result in results:
        for rank in result.ranks:
            policies: Mapping[tuple[int, int], str] = rank.chunk_policy
            for chunk, measured in rank.chunk_bytes.items():
                stage, policy = chunk[0], policies.get(chunk, "keep")
                if policy in ("keep", "swap"):
                    kept[stage] = max(kept.get(stage, 0), measured.held)
                if policy == "swap" and measured.moved is not None:
                    moved[stage] = min(moved.get(stage, measured.moved), measured.moved)
                if policy == "recompute" and measured.regenerated is not None:
                    held[stage] = max(held.get(stage, 0), measured.held)
                    regenerated[stage] = max(regenerated.get(stage, 0), measured.regenerated)
                    both = measured.held + measured.regenerated
                    recompute_kept[stage] = max(recompute_kept.get(stage, 0), both)
    missing = [s for s in range(num_stages) if s not in kept and s not in recompute_kept]
    if missing:
        raise ValueError(
            f"result measured no chunk of stage(s) {missing}: CostModel.from_result needs a "
            "run with count_saved_bytes=True whose ranks are all in this process"
        )
    return tuple(
        StageBytes(
            kept=kept.get(stage, recompute_kept.get(stage, 0)),
            moved=moved.get(stage),
            recompute_held=held.get(stage),
            regenerated=regenerated.get(stage),
        )
        for stage in range(num_stages)
    )


def _mean_job(results: list[Any], *kinds: str) -> float | None:
    seconds = count = 0.0
    for result in results:
        for rank in result.ranks:
            for kind in kinds:
                seconds += rank.compute_job_s.get(kind, 0.0)
                count += rank.compute_jobs.get(kind, 0)
    return seconds / count if count and seconds > 0 else None


def calibrated_fields(
    results: Iterable[Any], *, num_stages: int, copy_gbps: float | None, shared_compute: bool
) -> dict[str, Any]:
    """The keyword arguments of a CostModel measured from ``results`` (module docstring);
    ``copy_gbps``: the bandwidth to plan with (None: measured, else the default)."""
    results = list(results)
    if not results:
        raise ValueError("CostModel.from_result needs at least one RunResult")
    stage_bytes = _stage_bytes(results, num_stages)
    leaf_s = _mean_job(results, "forward") or DEFAULT_LEAF_S
    backward = _mean_job(results, "backward")
    split = _mean_job(results, "backward_input")
    backward_leaf_s = backward if backward is not None else (None if split is None else 2 * split)
    gbps = copy_gbps
    if gbps is None:
        busy = sum(rank.copy_busy_s for result in results for rank in result.ranks)
        moved = sum(
            rank.offloaded_bytes + rank.loaded_bytes for result in results for rank in result.ranks
        )
        gbps = moved / busy / 1e9 if busy > 0 and moved > 0 else DEFAULT_COPY_GBPS
    return {
        "chunk_bytes": tuple(s.moved if s.moved is not None else s.kept for s in stage_bytes),
        "d2h_gbps": gbps,
        "h2d_gbps": gbps,
        "leaf_s": leaf_s,
        "backward_leaf_s": backward_leaf_s,
        "recompute_leaf_s": _mean_job(results, "recompute"),
        "swap_step_s": _mean_job(results, "swap_prepare", "swap_finish") or 0.0,
        "shared_compute": shared_compute,
        "stage_bytes": stage_bytes,
    }
