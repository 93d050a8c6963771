"""Tied parameters at run time: found when the run is planned, summed when it ends.

A parameter several stages hold (tied embeddings: a GPT-2 head that multiplies by the
input embedding's weight) gets, in each stage's backward, only that stage's share of its
gradient. After a successful training run every holder's ``stage.grads`` entry for it is
the whole gradient: the sum of the holders' shares, added in stage order (stage index
ascending), so every holder has the same bits. The plan shows the sum as each holder
rank's last step, TIED_GRAD_SUM (``ppswap.scheduler.ties``); the runtime runs it once the
rank's actors are done, before the gradients are given to the parameters.

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
the declarations are all-gathered once per set of stages and layout (the first run), at
the start of the run, before any forward.

Across processes a tie whose holders are on several ranks is one ``all_gather`` among
them (every transport offers it over any group of ranks): each rank sends its holders'
gradients, every member adds all of them in stage order (numpy, as the transports' own
``reduce_scatter_sum``); holders on one rank are summed by the framework. Either way the
sum is the same on every holder, and a parameter object held by several stages is given
to the framework once (torch: ``.grad`` gets the sum once).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np

from ppswap.backends.base import Backend
from ppswap.backends.types import HostArray, Tensor
from ppswap.core.dtypes import BFLOAT16, is_bfloat16
from ppswap.core.executor import DedicatedThread
from ppswap.core.transport import Transport, is_distributed
from ppswap.errors import PipelineHangError
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.fsdp.plan import replica_of
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.steps import Order
from ppswap.scheduler.ties import with_tie_steps
from ppswap.stage import PipelineStage
from ppswap.stage_run import StageRun, StageRuns

__all__ = [
    "NO_TIES",
    "TieCopy",
    "TieGroup",
    "Ties",
    "grads_to_give",
    "orders_with_ties",
    "plan_ties",
    "resolve_ties",
    "sum_tied_grads",
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
class _Holder:
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

    local: Mapping[tuple[str, int], tuple[_Holder, ...]]
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
    local: dict[tuple[str, int], tuple[_Holder, ...]] = {}
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


def _holder(backend: Backend, stage: PipelineStage, index: int, name: str) -> _Holder:
    param = stage.parameters[index]
    dtype = backend.numpy_dtype(param)
    copy = TieCopy(
        stage.stage_index,
        replica_of(stage),
        name,
        tuple(backend.shape_of(param)),
        "?" if dtype is None else str(dtype),
    )
    return _Holder(stage, index, copy)


def _check_alike(key: str, copies: Sequence[TieCopy]) -> None:
    first = copies[0]
    for copy in copies[1:]:
        if (copy.shape, copy.dtype) != (first.shape, first.dtype):
            raise ValueError(
                f"tied {key!r}: {first.described()} and {copy.described()} differ; the "
                "copies of a tie must agree in shape and dtype"
            )


def _world_rank(config: ScheduleConfig, mesh: DeviceMesh | None, copy: TieCopy) -> int:
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
        ranks = tuple(sorted({_world_rank(config, mesh, c) for c in copies}))
        groups.append(TieGroup(key, replica, tuple(copies), ranks))
    return tuple(sorted(groups, key=lambda g: (g.replica, g.copies[0].stage)))


def orders_with_ties(
    config: ScheduleConfig, orders: Sequence[Order], groups: Sequence[TieGroup]
) -> tuple[Order, ...]:
    """``orders`` as the plan shows them: each holder rank's TIED_GRAD_SUM steps last."""
    stage_sets = sorted({g.stages for g in groups})
    return with_tie_steps(config, orders, stage_sets) if stage_sets else tuple(orders)


# -- the run's start: every process's declarations -------------------------------------

# What each set of stages last learned from the other processes: a memo, as the planner
# keeps its plans (``planned_orders``), so that steps after the first exchange nothing.
_GATHERED: weakref.WeakKeyDictionary[PipelineStage, tuple[object, tuple[TieGroup, ...]]] = (
    weakref.WeakKeyDictionary()
)


async def resolve_ties(
    ties: Ties,
    stages: Sequence[PipelineStage],
    transport: Transport,
    config: ScheduleConfig,
    mesh: DeviceMesh | None,
    timeout_s: float,
) -> tuple[TieGroup, ...]:
    """Every tie of the run with all its copies. Across processes the first run of a set
    of stages (and after a change of layout or declarations) all-gathers every process's
    declared copies among all ranks, before any forward: every rank of the job must run
    it (a rank refused here fails before its first step). Raises ValueError for the
    cross-process refusals of ``plan_ties`` (the same on every rank)."""
    if ties.groups is not None:
        return ties.groups
    if not is_distributed(transport):
        raise TypeError(f"transport must be a distributed one, got {type(transport).__name__}")
    mine = ties.records(declared=True)
    memo_key = (id(transport), config.num_stages, config.pp, mesh, tuple(mine))
    kept = [_GATHERED.get(stage) for stage in stages]
    if kept and all(entry is not None and entry[0] == memo_key for entry in kept):
        entry = kept[0]
        assert entry is not None
        return entry[1]
    body = json.dumps([[key, *_fields(copy)] for key, copy in mine]).encode()
    everyone = tuple(range(transport.world_size))
    with _deadline(timeout_s, transport.rank, "the exchange of tied declarations"):
        gathered = await transport.all_gather(
            transport.rank, everyone, _EXCHANGE_KEY, np.frombuffer(body, dtype=np.uint8).copy()
        )
    records: list[_Record] = []
    for array in gathered:
        for key, stage, replica, name, shape, dtype in json.loads(bytes(array).decode()):
            records.append((key, TieCopy(stage, replica, name, tuple(shape), dtype)))
    groups = _groups_of(records + ties.records(declared=False), config, mesh)
    for stage in stages:
        _GATHERED[stage] = (memo_key, groups)
    return groups


def _fields(copy: TieCopy) -> list[object]:
    return [copy.stage, copy.replica, copy.name, list(copy.shape), copy.dtype]


@contextmanager
def _deadline(timeout_s: float, rank: int, what: str) -> Iterator[None]:
    """``anyio.fail_after`` whose timeout is a PipelineHangError naming the rank."""
    try:
        with anyio.fail_after(timeout_s):
            yield
    except TimeoutError as exc:
        raise PipelineHangError(
            f"{what} missed its deadline ({timeout_s:g} s)",
            rank=rank,
            actor="runtime",
            step="TIED_GRAD_SUM",
            dump="(after the rank's actors ended: no flight recorder)",
        ) from exc


# -- the run's end: TIED_GRAD_SUM --------------------------------------------------------


async def sum_tied_grads(
    ties: Ties,
    groups: Sequence[TieGroup],
    runs: StageRuns,
    backend: Backend,
    compute: DedicatedThread,
    transport: Transport,
    config: ScheduleConfig,
    mesh: DeviceMesh | None,
    timeout_s: float,
) -> None:
    """After a successful training run: every holder's gradient of each tie (in its
    stage's ``runs``) becomes the sum over the tie's holders, added in stage order (module
    docstring). The framework's work runs on ``compute``; a tie held by several processes
    is one all-gather among them, with the step deadline."""
    mine = [g for g in groups if (g.key, g.replica) in ties.local]
    if not mine:
        return
    totals: dict[tuple[str, int], HostArray] = {}
    if is_distributed(transport) and (spread := [g for g in mine if len(g.ranks) > 1]):
        rank = transport.rank
        parts = await compute.run(_host_parts, ties, spread, runs, backend)
        with _deadline(timeout_s, rank, "the sum of tied gradients"):
            for group in spread:
                key = (group.key, group.replica)
                gathered = await transport.all_gather(
                    rank, group.ranks, f"ppswap.tie.{group.replica}.{group.key}", parts[key]
                )
                totals[key] = _fold_gathered(group, gathered, config, mesh)
    await compute.run(_install, ties, mine, totals, runs, backend)


def _grad_of(backend: Backend, runs: StageRuns, holder: _Holder) -> Tensor:
    param, grad = runs[holder.stage].run_grads()[holder.index]
    return backend.zeros_like(param) if grad is None else grad


def _host_parts(
    ties: Ties, groups: Sequence[TieGroup], runs: StageRuns, backend: Backend
) -> dict[tuple[str, int], HostArray]:
    """Compute thread: per tie, this process's holders' gradients stacked in stage order."""
    return {
        (g.key, g.replica): np.stack(
            [
                backend.to_host(_grad_of(backend, runs, h), copy=True)
                for h in ties.local[(g.key, g.replica)]
            ]
        )
        for g in groups
    }


def _fold_gathered(
    group: TieGroup,
    gathered: Sequence[HostArray],
    config: ScheduleConfig,
    mesh: DeviceMesh | None,
) -> HostArray:
    """The sum of every holder's gradient in stage order (``g_0 + g_1 + ...``, a new
    array), from each member rank's stacked part. bfloat16 parts are added as
    ``ml_dtypes``' type whichever numpy type carried them (as ``sum_contributions``)."""
    rows: dict[int, HostArray] = {}
    for rank, part in zip(group.ranks, gathered, strict=True):
        held = [c.stage for c in group.copies if _world_rank(config, mesh, c) == rank]
        if part.shape[0] != len(held):
            raise ValueError(
                f"tied {group.key!r}: rank {rank} sent {part.shape[0]} gradients, expected "
                f"{len(held)} (stages {held})"
            )
        for stage, row in zip(held, part, strict=True):
            rows[stage] = row.view(BFLOAT16) if BFLOAT16 and is_bfloat16(row.dtype) else row
    ordered = [rows[stage] for stage in group.stages]
    total = ordered[0].copy()
    for row in ordered[1:]:
        total += row
    return total


def _install(
    ties: Ties,
    groups: Sequence[TieGroup],
    totals: Mapping[tuple[str, int], HostArray],
    runs: StageRuns,
    backend: Backend,
) -> None:
    """Compute thread: each holder's gradient of each tie replaced by the tie's sum (a
    host total from the other processes, or the framework's sum of the holders here).
    One tensor per parameter object: holders of one object share it, distinct copies
    each get their own (an optimizer may change a gradient in place)."""
    replaced: dict[int, tuple[StageRun, list[Tensor | None]]] = {}
    for group in groups:
        holders = ties.local[(group.key, group.replica)]
        total_host = totals.get((group.key, group.replica))
        if total_host is None:
            total: Tensor = None
            for holder in holders:
                grad = _grad_of(backend, runs, holder)
                total = grad if total is None else total + grad
        by_object: dict[int, Tensor] = {}
        for holder in holders:
            param = holder.stage.parameters[holder.index]
            tensor = by_object.get(id(param))
            if tensor is None:
                if total_host is not None:
                    tensor = backend.from_host(total_host.copy(), like=param)
                elif not by_object:
                    tensor = total
                else:
                    tensor = backend.from_payload(
                        backend.to_payload(total, copy=True, host=False), like=param
                    )
                by_object[id(param)] = tensor
            stage = runs[holder.stage]
            if id(stage) not in replaced:
                replaced[id(stage)] = (stage, [grad for _, grad in stage.run_grads()])
            replaced[id(stage)][1][holder.index] = tensor
    for stage, grads in replaced.values():
        stage.replace_grads(grads)


def grads_to_give(
    stages: Sequence[StageRun],
) -> tuple[list[Tensor], list[Tensor | None]]:
    """Every stage's ``(parameter, gradient)`` pairs, each parameter object once (its
    first stage's: after ``sum_tied_grads`` every holder's is the whole sum), as
    ``Backend.give_grads`` takes them."""
    params: list[Tensor] = []
    grads: list[Tensor | None] = []
    seen: set[int] = set()
    for stage in stages:
        for param, grad in stage.run_grads():
            if id(param) not in seen:
                seen.add(id(param))
                params.append(param)
                grads.append(grad)
    return params, grads
