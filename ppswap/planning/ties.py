"""Tied parameters, planned: which parameters several stages hold, checked before the run.

A parameter several stages hold (tied embeddings: a GPT-2 head that multiplies by the
input embedding's weight) gets, in each stage's backward, only that stage's share of its
gradient. After a successful training run every holder's ``stage.grads`` entry for it is
the whole gradient: the sum of the holders' shares, added in stage order (stage index
ascending), so every holder has the same bits. Each holder rank's order ends with a
TIED_GRAD_SUM step per set of stages it shares ties with (``orders_with_ties``,
``ppswap.scheduler.ties``); its compute actor runs it (``ppswap.actors.tie_sum``).

Ties are found two ways (``plan_ties``, from the run's planning):

- in one process, by identity: a parameter object in several stages' ``parameters``;
- declared, by parameter name per stage: ``PipelineStage(module, i, n, tied={"wte.weight":
  "embedding"})``, the same key on every stage that holds a copy (one process per rank
  cannot see the other processes' objects). Copies that are distinct objects are summed
  too and each keeps its own tensor.

With FSDP a tie is per dp replica and its shards are summed shard by shard (each holder
holds the same rows of the same shape). Refused before anything runs (ValueError): a
declared name that is not a trainable parameter of the stage's module, a key declared
twice on one stage, one parameter object under two keys, a key that only one stage
declares, and copies that differ in shape or dtype (naming both stages). Across processes
every training run all-gathers the declarations among all ranks at its start, before any
forward (``resolve_ties``): the ties, and so the orders, are the same on every rank.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from ppswap.backends.base import Backend
from ppswap.core.transport import Transport, is_distributed
from ppswap.errors import PipelineHangError
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.fsdp.plan import replica_of
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import Order
from ppswap.scheduler.ties import with_tie_steps
from ppswap.stage import PipelineStage

__all__ = [
    "NO_TIES",
    "TieCopy",
    "TieGroup",
    "TieHolder",
    "Ties",
    "orders_with_ties",
    "plan_ties",
    "resolve_ties",
    "world_rank_of",
]

_EXCHANGE_KEY = "ppswap.ties"

Node = tuple[int, int, int]
"""A parameter of a stage: ``(stage index, dp replica, index in stage.parameters)``."""


@dataclass(frozen=True, slots=True)
class TieCopy:
    """One holder of a tie: its stage and dp replica, the parameter's name there, and the
    parameter's shape and dtype (as numpy names it)."""

    stage: int
    replica: int
    name: str
    shape: tuple[int, ...]
    dtype: str

    def described(self) -> str:
        return f"stage {self.stage}'s {self.name!r} {self.shape} {self.dtype}"


@dataclass(frozen=True, slots=True)
class TieGroup:
    """A tie: ``key`` (declared, or the first holder's parameter for one found by
    identity alone), its dp ``replica``, every copy in stage order and the world ranks
    holding them, ascending."""

    key: str
    replica: int
    copies: tuple[TieCopy, ...]
    ranks: tuple[int, ...]

    @property
    def stages(self) -> tuple[int, ...]:
        return tuple(copy.stage for copy in self.copies)


@dataclass(frozen=True, slots=True)
class TieHolder:
    """A copy held in this process: its stage and the parameter's index there."""

    stage: PipelineStage
    index: int
    copy: TieCopy


_Record = tuple[str, TieCopy]
"""A copy under its tie's key: what the processes exchange."""


@dataclass(frozen=True, slots=True)
class Ties:
    """The ties of a run as planned: per tie ``(key, replica)`` the copies this process
    holds, in stage order; ``declared``: the ties with a declared key (copies may be in
    other processes); ``groups``: every tie with all its copies, or None until the other
    processes' declarations are gathered (``resolve_ties``)."""

    local: Mapping[tuple[str, int], tuple[TieHolder, ...]]
    declared: frozenset[tuple[str, int]]
    groups: tuple[TieGroup, ...] | None

    def records(self, *, declared: bool) -> list[_Record]:
        return [
            (key, holder.copy)
            for (key, replica), holders in sorted(self.local.items())
            if ((key, replica) in self.declared) == declared
            for holder in holders
        ]


NO_TIES = Ties(local={}, declared=frozenset(), groups=())


def plan_ties(
    stages: Sequence[PipelineStage],
    backend: Backend,
    config: ScheduleConfig,
    mesh: DeviceMesh | None,
    *,
    distributed: bool,
) -> Ties:
    """The ties of a run over ``stages`` (this process's), checked (module docstring).
    ``distributed``: other processes hold other stages, so a declared key may have copies
    there; the groups are then completed by ``resolve_ties`` at the run's start."""
    ordered = sorted(stages, key=lambda s: (replica_of(s), s.stage_index))
    at = {(s.stage_index, replica_of(s)): s for s in ordered}
    names: dict[Node, str] = {}
    keys: dict[Node, str] = {}
    parent: dict[Node, Node] = {}

    def find(node: Node) -> Node:
        parent.setdefault(node, node)
        while parent[node] != node:
            node = parent[node] = parent[parent[node]]
        return node

    by_key: dict[tuple[str, int], Node] = {}
    by_object: dict[int, Node] = {}
    for stage in ordered:
        replica = replica_of(stage)
        for name, key in _declared(stage).items():
            node = (stage.stage_index, replica, _index_of(stage, name))
            if node in keys:
                raise ValueError(
                    f"tied: stage {stage.stage_index} declares {names[node]!r} as "
                    f"{keys[node]!r} and {name!r} as {key!r}, but they are one parameter"
                )
            names[node], keys[node] = name, key
            other = by_key.setdefault((key, replica), node)
            if other[0] == node[0] and other != node:
                raise ValueError(
                    f"tied: stage {stage.stage_index} declares key {key!r} for "
                    f"{names[other]!r} and {name!r}; allowed: one parameter per key and stage"
                )
            parent[find(node)] = find(other)
        for index, param in enumerate(stage.parameters):
            node = (stage.stage_index, replica, index)
            seen = by_object.setdefault(id(param), node)
            if seen != node:
                parent[find(node)] = find(seen)
                for each in (seen, node):
                    names.setdefault(each, _default_name(backend, at[each[:2]], each[2]))
    components: dict[Node, list[Node]] = {}
    for node in names:
        components.setdefault(find(node), []).append(node)
    local: dict[tuple[str, int], tuple[TieHolder, ...]] = {}
    declared = set()
    for members in components.values():
        members.sort()
        holders = tuple(_holder(backend, at[node[:2]], node[2], names[node]) for node in members)
        found = sorted({keys[n] for n in members if n in keys})
        if len(found) > 1:
            where = ", ".join(h.copy.described() for h in holders)
            raise ValueError(f"tied: keys {found} name one parameter object ({where})")
        key = found[0] if found else f"{holders[0].copy.name} of stage {members[0][0]}"
        _check_alike(key, [h.copy for h in holders])
        local[(key, members[0][1])] = holders
        if found:
            declared.add((key, members[0][1]))
    ties = Ties(local=local, declared=frozenset(declared), groups=None)
    if distributed:
        return ties
    records = ties.records(declared=True) + ties.records(declared=False)
    return Ties(local=local, declared=ties.declared, groups=_groups_of(records, config, mesh))


def _declared(stage: PipelineStage) -> Mapping[str, str]:
    tied = getattr(stage, "tied", None) or {}
    if not isinstance(tied, Mapping):
        raise TypeError(
            f"tied must map parameter names to tie keys, got {type(tied).__name__} on "
            f"stage {stage.stage_index}"
        )
    for name, key in tied.items():
        if not isinstance(name, str) or not isinstance(key, str) or not key:
            raise TypeError(
                f"tied on stage {stage.stage_index} must map parameter names (str) to "
                f"non-empty keys (str), got {name!r}: {key!r}"
            )
    return tied


def _index_of(stage: PipelineStage, name: str) -> int:
    """The index in ``stage.parameters`` of the parameter at attribute path ``name``."""
    target: Any = stage.module
    try:
        for part in name.split("."):
            target = getattr(target, part)
    except AttributeError:
        target = None
    for index, param in enumerate(stage.parameters):
        if param is target:
            return index
    raise ValueError(
        f"tied: {name!r} is not a trainable parameter of stage {stage.stage_index}'s module "
        "(allowed: the attribute path of one, such as 'wte.weight')"
    )


def _default_name(backend: Backend, stage: PipelineStage, index: int) -> str:
    return f"parameter {index} ({backend.parameter_name(stage.parameters[index])})"


def _holder(backend: Backend, stage: PipelineStage, index: int, name: str) -> TieHolder:
    param = stage.parameters[index]
    dtype = backend.numpy_dtype(param)
    copy = TieCopy(
        stage.stage_index,
        replica_of(stage),
        name,
        tuple(backend.shape_of(param)),
        "?" if dtype is None else str(dtype),
    )
    return TieHolder(stage, index, copy)


def _check_alike(key: str, copies: Sequence[TieCopy]) -> None:
    first = copies[0]
    for copy in copies[1:]:
        if (copy.shape, copy.dtype) != (first.shape, first.dtype):
            raise ValueError(
                f"tied {key!r}: {first.described()} and {copy.described()} differ; the "
                "copies of a tie must agree in shape and dtype"
            )


def world_rank_of(config: ScheduleConfig, mesh: DeviceMesh | None, copy: TieCopy) -> int:
    """The world rank holding ``copy`` (its pipeline rank, in its dp replica's block)."""
    rank = config.rank_of(copy.stage)
    return rank if mesh is None else rank + copy.replica * mesh.pp


def _groups_of(
    records: Sequence[_Record], config: ScheduleConfig, mesh: DeviceMesh | None
) -> tuple[TieGroup, ...]:
    """Every tie of the run from every copy of it (``records``), checked; in order of
    (replica, first stage)."""
    by_tie: dict[tuple[str, int], dict[int, TieCopy]] = {}
    for key, copy in records:
        by_tie.setdefault((key, copy.replica), {})[copy.stage] = copy
    groups = []
    for (key, replica), found in by_tie.items():
        copies = [found[stage] for stage in sorted(found)]
        if len(copies) < 2:
            raise ValueError(
                f"tied {key!r} is declared only by stage {copies[0].stage}; a tie needs the "
                "same key on two or more stages"
            )
        _check_alike(key, copies)
        ranks = tuple(sorted({world_rank_of(config, mesh, c) for c in copies}))
        groups.append(TieGroup(key, replica, tuple(copies), ranks))
    return tuple(sorted(groups, key=lambda g: (g.replica, g.copies[0].stage)))


def orders_with_ties(
    config: ScheduleConfig, orders: Sequence[Order], groups: Sequence[TieGroup]
) -> tuple[Order, ...]:
    """``orders`` as the plan shows them: each holder rank's TIED_GRAD_SUM steps last."""
    stage_sets = sorted({g.stages for g in groups})
    return with_tie_steps(config, orders, stage_sets) if stage_sets else tuple(orders)


# -- the run's start: every process's declarations -------------------------------------


async def resolve_ties(
    ties: Ties,
    transport: Transport,
    config: ScheduleConfig,
    mesh: DeviceMesh | None,
    timeout_s: float,
) -> tuple[TieGroup, ...]:
    """Every tie of the run with all its copies. Across processes every training run
    all-gathers every process's declared copies among all ranks, before any forward
    (one small message per peer): a rank that changed its declarations since the last
    run is seen by all, and every rank of the job takes part whether or not it declares
    anything (a rank refused here fails before its first step). Raises ValueError for
    the cross-process refusals of ``plan_ties`` (the same on every rank) and
    PipelineHangError where a rank does not take part within ``timeout_s``."""
    if ties.groups is not None:
        return ties.groups
    mine = ties.records(declared=True)
    if not is_distributed(transport):
        # A multi-process transport without collectives cannot exchange declarations:
        # nothing to exchange is fine, a declared tie is refused.
        if mine:
            raise TypeError(
                "tied parameters across processes need a transport with collectives "
                f"(MPITransport, TorchDistTransport), got {type(transport).__name__}"
            )
        return _groups_of(ties.records(declared=False), config, mesh)
    body = json.dumps([[key, *_fields(copy)] for key, copy in mine]).encode()
    everyone = tuple(range(transport.world_size))
    try:
        with anyio.fail_after(timeout_s):
            gathered = await transport.all_gather(
                transport.rank, everyone, _EXCHANGE_KEY, np.frombuffer(body, dtype=np.uint8).copy()
            )
    except TimeoutError as exc:
        raise PipelineHangError(
            f"the exchange of tied declarations among ranks {list(everyone)} missed its "
            f"deadline ({timeout_s:g} s): every rank of the job must start the run",
            rank=transport.rank,
            actor="runtime",
            step="tied declarations",
            dump="(before the run: no flight recorder)",
        ) from exc
    records: list[_Record] = []
    for array in gathered:
        for key, stage, replica, name, shape, dtype in json.loads(bytes(array).decode()):
            records.append((key, TieCopy(stage, replica, name, tuple(shape), dtype)))
    return _groups_of(records + ties.records(declared=False), config, mesh)


def _fields(copy: TieCopy) -> list[object]:
    return [copy.stage, copy.replica, copy.name, list(copy.shape), copy.dtype]
