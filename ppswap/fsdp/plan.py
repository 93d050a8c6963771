"""How a run with fully_shard()-ed stages is laid out: checks and per-world-rank pieces.

Used by ``ppswap.actors.prepare`` (before anything runs) and ``ppswap.actors.runtime``:

- ``resolve_mesh``: the mesh of a run, read from its stages (every stage sharded with one
  mesh, or none) and checked against an explicit ``mesh=`` argument;
- ``check_mesh``: the mesh must match the run's ranks (``mesh.pp`` pipeline ranks; across
  processes, one process per world rank over a transport with collectives);
- ``check_process_stages``: across processes, this process's stages must be those of its
  world rank (pipeline rank ``w % pp`` of dp replica ``w // pp``);
- ``replica_of``: the dp replica a stage belongs to (0 for an unsharded stage);
- ``world_orders``: the pipeline ranks' orders as every world rank runs them;
- ``collectives_for``: the collective side of a transport (None for a P2P-only one);
- ``param_storage_bytes``: measured parameter bytes of unsharded stages (pp-only runs).
"""

from __future__ import annotations

from collections.abc import Sequence

from ppswap.core.transport import (
    CollectiveTransport,
    DistributedTransport,
    MultiProcessTransport,
    Transport,
    is_collective,
)
from ppswap.fsdp.mesh import DeviceMesh, order_for_world_rank
from ppswap.fsdp.shard import fsdp_state_of
from ppswap.scheduler.steps import Order
from ppswap.stage import PipelineStage

__all__ = [
    "check_mesh",
    "check_process_stages",
    "collectives_for",
    "param_storage_bytes",
    "replica_of",
    "resolve_mesh",
    "world_orders",
]


def replica_of(stage: PipelineStage) -> int:
    """The dp replica of ``stage``: its module's ``fully_shard`` dp_rank, else 0."""
    state = fsdp_state_of(stage.module)
    return 0 if state is None else state.dp_rank


def resolve_mesh(stages: Sequence[PipelineStage], mesh: object) -> DeviceMesh | None:
    """The run's mesh: the one every stage was sharded with (None when no stage is).

    Refuses a mix of sharded and unsharded stages, stages sharded with different meshes
    (their dp groups would differ) and an explicit ``mesh`` that is not theirs.
    """
    if mesh is not None and not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a ppswap.DeviceMesh or None, got {type(mesh).__name__}")
    states = [(stage, fsdp_state_of(stage.module)) for stage in stages]
    unsharded = [stage.stage_index for stage, state in states if state is None]
    meshes = {state.mesh for _, state in states if state is not None}
    if not meshes:
        if mesh is not None:
            raise ValueError(
                f"mesh={mesh!r} was given but no stage is fully_shard()-ed; shard every "
                "stage's module with fully_shard(module, mesh=mesh, dp_rank=...)"
            )
        return None
    if unsharded:
        raise ValueError(
            f"every stage must be fully_shard()-ed or none; stages {sorted(unsharded)} are "
            f"not, the others are sharded with {sorted(map(repr, meshes))}"
        )
    if len(meshes) != 1:
        raise ValueError(
            "the dp group differs between stages: they were fully_shard()-ed with the "
            f"meshes {sorted(map(repr, meshes))}; shard every stage with one DeviceMesh"
        )
    (found,) = meshes
    if mesh is not None and mesh != found:
        raise ValueError(
            f"mesh={mesh!r} differs from the mesh the stages were sharded with, {found!r}"
        )
    return found


def check_mesh(mesh: DeviceMesh, pp: int, transport: MultiProcessTransport | None) -> None:
    """The mesh must match the run's ranks: ``mesh.pp == pp``. ``transport`` is the
    multi-process transport (None in one process): then every world rank is its own
    process, so its world size must be ``mesh.world_size``, and it must have the
    collectives and be configured per run (``MPITransport``, ``TorchDistTransport``)."""
    if mesh.pp != pp:
        raise ValueError(
            f"mesh={mesh!r} does not match the run's ranks: mesh.pp * mesh.dp = "
            f"{mesh.world_size} ranks need mesh.pp == pp, got pp={pp} pipeline ranks"
        )
    if transport is None:
        return
    if not (
        isinstance(transport, CollectiveTransport) and isinstance(transport, DistributedTransport)
    ):
        raise TypeError(
            f"transport must have collectives (all_gather, reduce_scatter_sum) and configure "
            f"for fully_shard()-ed stages across processes (MPITransport, TorchDistTransport), "
            f"got {type(transport).__name__}"
        )
    if transport.world_size != mesh.world_size:
        raise ValueError(
            f"the transport's world size must equal mesh.pp * mesh.dp = {mesh.world_size} "
            f"for mesh={mesh!r} (one process per world rank), got world_size="
            f"{transport.world_size}"
        )


def check_process_stages(
    stages: Sequence[PipelineStage], mesh: DeviceMesh, rank: int, expected: Sequence[int]
) -> None:
    """Across processes: world rank ``rank`` runs the stage indices ``expected`` (those of
    its pipeline rank ``rank % pp``), each once, as dp replica ``rank // pp``."""
    coords = mesh.coords(rank)
    where = (
        f"world rank {rank}, pipeline rank {coords.pp} of dp replica {coords.dp} "
        f"(mesh={mesh!r}: world rank w is pipeline rank w % pp of replica w // pp)"
    )
    wrong = sorted((s.stage_index, replica_of(s)) for s in stages if replica_of(s) != coords.dp)
    if wrong:
        raise ValueError(
            f"stages must be fully_shard()-ed with dp_rank={coords.dp} for {where}, got "
            f"(stage, dp_rank) pairs {wrong}"
        )
    given = sorted(s.stage_index for s in stages)
    if given != sorted(expected):
        raise ValueError(
            f"stages must cover stage indices {sorted(expected)} exactly once for {where}, "
            f"got {given}"
        )


def world_orders(orders: Sequence[Order], mesh: DeviceMesh | None) -> tuple[Order, ...]:
    """Orders indexed by world rank: rank ``w`` runs pipeline rank ``w % pp``'s order with
    its peers in its own replica. Without a mesh, ``orders`` unchanged."""
    if mesh is None:
        return tuple(orders)
    if len(orders) != mesh.pp:
        raise ValueError(f"expected {mesh.pp} pipeline orders for {mesh!r}, got {len(orders)}")
    return tuple(
        order_for_world_rank(orders[rank % mesh.pp], mesh, rank) for rank in range(mesh.world_size)
    )


def collectives_for(transport: Transport) -> CollectiveTransport | None:
    """The transport's collective side (InProcessTransport, MPITransport), else None."""
    return transport if is_collective(transport) else None


def param_storage_bytes(stages: Sequence[PipelineStage]) -> int:
    """Measured bytes of the distinct storages behind the stages' parameters (compute
    thread)."""
    seen: dict[int, int] = {}
    for stage in stages:
        for param in stage.backend.all_parameters(stage.module):
            storage = stage.backend.storage_of(param)
            seen[storage.ptr] = storage.nbytes
    return sum(seen.values())
