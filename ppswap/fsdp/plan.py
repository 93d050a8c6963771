"""How a run with fully_shard()-ed stages is laid out: one checked ``MeshPlan``.

``plan_mesh`` is what run assembly (``ppswap.planning.prepare``) asks, once, before
anything runs: the run's mesh, read from its stages (every stage sharded with one mesh,
or none) and checked against an explicit ``mesh=`` and ``pp=``, the transport (across
processes: one process per world rank, with collectives) and the stages' replicas (in
one process every dp replica holds the same stage indices, each once; across processes,
this process's stages are those of its world rank's replica). The ``MeshPlan`` it returns
answers the rest: the world ranks this process runs, each world rank's stages and dp
replica, the pipeline orders as every world rank runs them.

Also here: ``replica_of`` (the dp replica a stage belongs to, 0 for an unsharded stage),
``collectives_for`` (the collective side of a transport, None for a P2P-only one) and
``param_storage_bytes`` (measured parameter bytes of unsharded stages: pp-only runs).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ppswap.core.transport import (
    CollectiveTransport,
    DistributedTransport,
    MultiProcessTransport,
    Transport,
    is_all_to_all,
    is_collective,
)
from ppswap.fsdp.mesh import DeviceMesh, order_for_world_rank
from ppswap.fsdp.shard import fsdp_state_of
from ppswap.scheduler.steps import Order
from ppswap.stage import PipelineStage

__all__ = ["MeshPlan", "collectives_for", "param_storage_bytes", "plan_mesh", "replica_of"]


def replica_of(stage: PipelineStage) -> int:
    """The dp replica of ``stage``: its module's ``fully_shard`` dp_rank, else 0."""
    state = fsdp_state_of(stage.module)
    return 0 if state is None else state.dp_rank


@dataclass(frozen=True, slots=True)
class MeshPlan:
    """The checked FSDP layout of a run (module docstring). ``world_rank``: this process's
    world rank when each world rank is its own process, None when they all run here."""

    mesh: DeviceMesh
    world_rank: int | None

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The world ranks this process runs."""
        if self.world_rank is not None:
            return (self.world_rank,)
        return tuple(range(self.mesh.world_size))

    @property
    def dp(self) -> int:
        return self.mesh.dp

    def dp_index(self, rank: int) -> int:
        """The dp replica of world rank ``rank``."""
        return self.mesh.coords(rank).dp

    def pipeline_rank(self, rank: int) -> int:
        """The pipeline rank world rank ``rank`` runs (``rank % pp``)."""
        return self.mesh.coords(rank).pp

    def where(self, rank: int) -> str:
        """World rank ``rank`` described for an error message."""
        coords = self.mesh.coords(rank)
        return (
            f"world rank {rank}, pipeline rank {coords.pp} of dp replica {coords.dp} "
            f"(mesh={self.mesh!r}: world rank w is pipeline rank w % pp of replica w // pp)"
        )

    def stages_of(
        self, rank: int, stages: Sequence[PipelineStage], rank_of: Callable[[int], int]
    ) -> tuple[PipelineStage, ...]:
        """The stages world rank ``rank`` runs: those of its replica whose stage index the
        schedule places (``rank_of``) on its pipeline rank."""
        coords = self.mesh.coords(rank)
        return tuple(
            s for s in stages if rank_of(s.stage_index) == coords.pp and replica_of(s) == coords.dp
        )

    def world_orders(self, orders: Sequence[Order]) -> tuple[Order, ...]:
        """Orders indexed by world rank: rank ``w`` runs pipeline rank ``w % pp``'s order
        with its peers in its own replica."""
        mesh = self.mesh
        if len(orders) != mesh.pp:
            raise ValueError(f"expected {mesh.pp} pipeline orders for {mesh!r}, got {len(orders)}")
        return tuple(
            order_for_world_rank(orders[rank % mesh.pp], mesh, rank)
            for rank in range(mesh.world_size)
        )


def plan_mesh(
    stages: Sequence[PipelineStage],
    mesh: object,
    pp: int | None,
    transport: MultiProcessTransport | None,
) -> MeshPlan | None:
    """The run's ``MeshPlan``, every check of the mesh done; None when no stage is
    fully_shard()-ed (and no ``mesh`` given). ``mesh``, ``pp``: the run's options;
    ``transport``: the multi-process transport (None in one process). Each refusal is a
    TypeError or ValueError naming the value and what is allowed."""
    found = _resolve_mesh(stages, mesh)
    if found is None:
        return None
    _check_mesh(found, found.pp if pp is None else pp, transport)
    if transport is None:
        _check_replicas(stages, found)
        return MeshPlan(found, None)
    plan = MeshPlan(found, transport.rank)
    _check_process_replica(stages, plan, transport.rank)
    return plan


def _check_replicas(stages: Sequence[PipelineStage], mesh: DeviceMesh) -> None:
    """In one process: every dp replica 0..dp-1 holds the same stage indices, each once."""
    pairs = sorted((s.stage_index, replica_of(s)) for s in stages)
    if len(set(pairs)) != len(pairs):
        raise ValueError(
            f"stages must not repeat a stage index (per dp replica), got (stage, dp_rank) "
            f"pairs {pairs}"
        )
    indices = sorted({index for index, _ in pairs})
    wanted = sorted((index, d) for index in indices for d in range(mesh.dp))
    if pairs != wanted:
        raise ValueError(
            f"stages must hold every stage index {indices} once per dp replica "
            f"0..{mesh.dp - 1} (mesh={mesh!r}), got (stage, dp_rank) pairs {pairs}"
        )


def _check_process_replica(stages: Sequence[PipelineStage], plan: MeshPlan, rank: int) -> None:
    """Across processes: world rank ``rank``'s stages are all of its dp replica ``rank //
    pp`` (which stage indices: ``ppswap.planning.prepare``, from the schedule)."""
    dp = plan.dp_index(rank)
    wrong = sorted((s.stage_index, replica_of(s)) for s in stages if replica_of(s) != dp)
    if wrong:
        raise ValueError(
            f"stages must be fully_shard()-ed with dp_rank={dp} for {plan.where(rank)}, got "
            f"(stage, dp_rank) pairs {wrong}"
        )


def _resolve_mesh(stages: Sequence[PipelineStage], mesh: object) -> DeviceMesh | None:
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


def _check_mesh(mesh: DeviceMesh, pp: int, transport: MultiProcessTransport | None) -> None:
    """The mesh must match the run's ranks: ``mesh.pp == pp``. ``transport`` is the
    multi-process transport (None in one process): then every world rank is its own
    process, so its world size must be ``mesh.world_size``, and it must have the
    collectives and be configured per run (``MPITransport``, ``TorchDistTransport``),
    and with ``mesh.ep > 1`` the all-to-all of expert parallelism."""
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
    if mesh.ep > 1 and not is_all_to_all(transport):
        raise TypeError(
            f"transport must have all_to_all for expert parallelism across processes "
            f"(mesh={mesh!r}: MPITransport, TorchDistTransport), got {type(transport).__name__}"
        )
    if transport.world_size != mesh.world_size:
        raise ValueError(
            f"the transport's world size must equal mesh.pp * mesh.dp = {mesh.world_size} "
            f"for mesh={mesh!r} (one process per world rank), got world_size="
            f"{transport.world_size}"
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
