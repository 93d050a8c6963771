"""What a run does differently when each rank is its own process (MPI, torch.distributed).

- Before the actors start, the transport gets the run's tag layout
  (``configure(num_stages, micro_count)``, which also starts a new message epoch, so a stale
  message of an earlier run is an error, never a wrong tensor).
- After the run every rank all-gathers a small float64 record (its RankStats, a flag, then
  the last stage's losses where it holds the last stage), so every process returns the
  same RunResult: per micro-batch the mean over the ranks holding the last stage (one
  rank, or with FSDP one per dp replica, in world-rank order: the in-process run's sum
  and division, so the value is bit-identical to it) and the stats of every rank,
  indexed by world rank. Rank 0 prints, say.
- When a rank fails, waiting peers would only notice at their watchdog deadline. A
  transport with ``abort_on_failure`` (MPITransport) ends the whole job instead: the
  failing rank writes its PipelineError to stderr, naming itself, then aborts every
  process (``MPI.COMM_WORLD.Abort``), so all of them exit non-zero at once.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ppswap.core.transport import DistributedTransport, is_distributed, is_run_configured
from ppswap.results import RankStats

__all__ = [
    "DistributedTransport",
    "abort_job",
    "configure_transport",
    "gather_results",
    "is_distributed",
]

_RESULT_KEY = "ppswap.run_result"
_LOCAL_FIELDS = frozenset({"chunk_policy", "chunk_bytes"})


def configure_transport(transport: object, num_stages: int, micro_count: int) -> None:
    """Give a transport configured per run the run's tag layout (and a new epoch)."""
    if is_run_configured(transport):
        transport.configure(num_stages, micro_count)


async def gather_results(
    transport: DistributedTransport,
    stats: RankStats,
    losses: list[float],
    micro_count: int,
) -> tuple[list[float], list[RankStats]]:
    """All-gather every rank's stats and the last stage's losses.

    ``stats`` is this rank's RankStats: a dataclass of numbers and of mappings of numbers
    (the compute-job times), laid out alike on every rank (same fields, same mapping keys
    in the same order). ``losses`` is this rank's per micro-batch loss, empty unless it
    holds the last stage. Returns per micro-batch the mean over the ranks that had losses
    (in rank order; one rank without FSDP, one per dp replica with it) and the stats of
    every rank, indexed by rank. ``chunk_policy`` and ``chunk_bytes`` (keyed by the rank's
    own chunks) are not gathered: another rank's are empty here (its own process reports
    them).
    """
    names = [f.name for f in dataclasses.fields(stats) if f.name not in _LOCAL_FIELDS]
    template = [getattr(stats, name) for name in names]
    layout = _layout(template)
    fields = _flatten(template, layout)
    flag = len(fields)
    record = np.full(flag + 1 + micro_count, math.nan, dtype=np.float64)
    record[:flag] = fields
    record[flag] = 1.0 if losses else 0.0
    if losses:
        record[flag + 1 :] = losses
    rank = transport.rank
    group = tuple(range(transport.world_size))
    records = await transport.all_gather(rank, group, _RESULT_KEY, record)
    everyone = [  # this rank's own as it is (its numbers survive the record exactly)
        stats
        if index == rank
        else RankStats(**dict(zip(names, _unflatten(layout, r[:flag].tolist()), strict=True)))
        for index, r in enumerate(records)
    ]
    holders = [r[flag + 1 :].tolist() for r in records if r[flag] == 1.0]
    # As the in-process run (runtime._collect_losses): a sum in rank (= dp) order, divided.
    gathered_losses = [
        sum(held[m] for held in holders) / len(holders)
        for m in range(micro_count if holders else 0)
    ]
    return gathered_losses, everyone


Layout = list[type | tuple[tuple[Any, type], ...]]
"""Per field of a RankStats, the type of its number, or of a mapping its keys and the
types of their numbers, in order."""


def _layout(template: list[Any]) -> Layout:
    """``template``'s layout: worked out once per run, used for every rank's record."""
    return [
        tuple((key, type(number)) for key, number in value.items())
        if isinstance(value, Mapping)
        else type(value)
        for value in template
    ]


def _flatten(template: list[Any], layout: Layout) -> list[float]:
    """Every number of ``template``, a mapping's values in its key order."""
    flat: list[float] = []
    for value, kind in zip(template, layout, strict=True):
        if type(kind) is tuple:
            flat += [float(number) for number in value.values()]
        else:
            flat.append(float(value))
    return flat


def _unflatten(layout: Layout, flat: list[float]) -> list[Any]:
    """Another rank's ``_flatten`` output back into the shape ``layout`` describes: the
    same mapping keys, each number of its type there."""
    numbers = iter(flat)
    values: list[Any] = []
    for kind in layout:
        if type(kind) is tuple:
            values.append({key: number_type(next(numbers)) for key, number_type in kind})
        else:
            values.append(kind(next(numbers)))  # type: ignore[operator]
    return values


@runtime_checkable
class AbortingTransport(Protocol):
    """A multi-process transport that can end every process of its job."""

    abort_on_failure: bool

    @property
    def rank(self) -> int: ...

    def abort(self, errorcode: int = 1) -> object:
        """End every process of the job (waits for stderr to get through first)."""
        ...


def abort_job(transport: object, error: BaseException) -> None:
    """End every process of the job if the transport asks for it (see module doc)."""
    if not isinstance(transport, AbortingTransport) or not transport.abort_on_failure:
        return
    rank = transport.rank
    print(f"ppswap: rank {rank} failed, aborting the job: {error}", file=sys.stderr, flush=True)
    transport.abort(1)
