"""``fully_shard``: dim-0 parameter shards of one dp replica's module, and their moves.

``fully_shard(module, mesh=mesh, dp_rank=d)`` (after swap_wrapper) shards every parameter of
``module`` along dim 0 across the ``mesh.dp`` replicas: the rows are padded with zeros to
``dp * rows`` (``rows = ceil(dim0 / dp)``) and replica ``d`` keeps rows
``d * rows .. (d + 1) * rows - 1``. The parameter's data is replaced by that shard (the
backend's ``set_parameter_data`` gives it the new storage), so the full storage is
released at once. A 0-d parameter is treated as shape ``(1,)``. The module may be of any
backend's framework; shards travel between replicas as host arrays.

In-process runs hold every dp replica's module copy in one process, so a module cannot
learn its dp index from the process: ``dp_rank`` says which replica this copy is (with one
process per rank it is ``mesh.coords(world_rank).dp``). Every replica must be built with
the same initial weights (the same seed): each keeps only its own rows of *its* copy.

Between uses a parameter holds its shard (shape ``(rows, *dims[1:])``), and after a run
``stage.grads`` holds the gradient of that shard (same shape): an optimizer steps on the
shards. ``full_parameters`` / ``full_gradients`` reassemble the full tensors from the
replicas held in this process (tests); ``gather_full_gradients`` does it across processes
(one process per world rank), over the transport's collectives.

Expert parameters (those of a MoE block, ``ppswap.core.all_to_all.ExpertBlock``) are not
sharded, whether ``ppswap.moe.expert_parallel`` split them before or after: they are the
state's ``kept`` parameters, whole between uses and during them. Their gradients are
summed over the ranks holding the same experts (``DeviceMesh.expert_replica_group``, by
the FSDP driver) and divided by ``dp`` like the shards' (``kept_grads``,
``shard_grads``).

The state machine (``FsdpState``; every method that touches a tensor runs on the compute
thread during a run)::

    SHARDED --snapshot_shard()--> (all-gather in flight) --install_full()--> UNSHARDED
    UNSHARDED --reshard()--> SHARDED

``snapshot_shard`` copies the local shard bytes (the all-gather payload, kept as the
shard while the full tensor is installed); ``install_full`` concatenates the gathered
shards, trims the padding and installs the full tensor; ``reshard`` installs the kept
shard again and drops the full tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ppswap.backends import backend_for
from ppswap.backends.base import Backend
from ppswap.backends.types import Module, Tensor
from ppswap.core.all_to_all import expert_parameter_ids
from ppswap.core.transport import AllGatherTransport, MultiProcessTransport
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.stage import PipelineStage

__all__ = [
    "FsdpState",
    "GradBucket",
    "ShardedParameter",
    "fsdp_state_of",
    "full_gradients",
    "full_parameters",
    "fully_shard",
    "gather_full_gradients",
]

Array = npt.NDArray[np.generic]

_STATE_ATTR = "_ppswap_fsdp_state"
_PARAM_MARK = "_ppswap_fsdp_sharded"


def _as_rows(array: Array, full_rows: int) -> Array:
    """``array`` (a full or shard tensor's data) as ``(rows, *dims[1:])``; 0-d as (1,)."""
    return array.reshape(full_rows, *array.shape[1:]) if array.ndim else array.reshape(1)


@dataclass(frozen=True, slots=True)
class ShardedParameter:
    """One parameter's shard layout: ``rows`` rows per replica, ``full_shape`` unsharded."""

    param: Tensor
    full_shape: tuple[int, ...]
    rows: int
    dtype: np.dtype[np.generic]

    @property
    def full_rows(self) -> int:
        return self.full_shape[0] if self.full_shape else 1

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.rows, *self.full_shape[1:])

    @property
    def shard_nbytes(self) -> int:
        return math.prod(self.shard_shape) * self.dtype.itemsize

    @property
    def full_nbytes(self) -> int:
        return math.prod(self.full_shape) * self.dtype.itemsize

    def split(self, full: Array, dp: int) -> list[Array]:
        """The ``dp`` shards of a full-shaped array, padded with zero rows (copies)."""
        rows = _as_rows(np.asarray(full), self.full_rows)
        padded = np.zeros((dp * self.rows, *rows.shape[1:]), dtype=rows.dtype)
        padded[: self.full_rows] = rows
        return [padded[d * self.rows : (d + 1) * self.rows].copy() for d in range(dp)]

    def join(self, shards: Sequence[Array]) -> Array:
        """The full array from every replica's shard, in dp order (padding trimmed)."""
        stacked = np.concatenate([np.asarray(s).reshape(self.shard_shape) for s in shards])
        return np.ascontiguousarray(stacked[: self.full_rows]).reshape(self.full_shape)


@dataclass(frozen=True, slots=True)
class GradBucket:
    """The gradients of one dtype, flattened for one reduce-scatter: ``contributions[j]``
    is what goes to dp member ``j`` (its rows of every gradient, padded)."""

    dtype: str
    indices: tuple[int, ...]
    contributions: tuple[Array, ...]


class FsdpState:
    """What ``fully_shard`` attached to a module: its mesh, dp rank and parameter shards."""

    def __init__(
        self,
        backend: Backend,
        mesh: DeviceMesh,
        dp_rank: int,
        params: tuple[ShardedParameter, ...],
        kept: tuple[Tensor, ...] = (),
    ) -> None:
        self.backend = backend
        self.mesh = mesh
        self.dp_rank = dp_rank
        self.params = params
        self.kept = kept
        self._kept_ids = frozenset(id(p) for p in kept)
        self._by_id = {id(p.param): p for p in params}
        self._snapshot: Array | None = None

    def __repr__(self) -> str:
        return (
            f"FsdpState(mesh={self.mesh!r}, dp_rank={self.dp_rank}, "
            f"params={len(self.params)}, unsharded={self.unsharded})"
        )

    @property
    def unsharded(self) -> bool:
        """True between ``snapshot_shard`` (the all-gather) and ``reshard``."""
        return self._snapshot is not None

    @property
    def full_nbytes(self) -> int:
        """Bytes the module's parameters take unsharded (from their shapes; the kept
        expert parameters as they are)."""
        kept = sum(self.backend.data_nbytes(p) for p in self.kept)
        return sum(p.full_nbytes for p in self.params) + kept

    def is_kept(self, param: Tensor) -> bool:
        """Whether ``param`` is an expert parameter, not sharded (module docstring)."""
        return id(param) in self._kept_ids

    def spec_of(self, param: Tensor) -> ShardedParameter:
        spec = self._by_id.get(id(param))
        if spec is None:
            name = self.backend.parameter_name(param)
            raise ValueError(f"parameter {name!r} is not sharded by this FsdpState")
        return spec

    # -- the moves (compute thread) ---------------------------------------------------------
    def snapshot_shard(self) -> Array:
        """Copy the local shards into one flat byte array (the all-gather payload) and keep
        it as the shard until ``reshard``. Raises if the module is not sharded."""
        if self._snapshot is not None:
            raise RuntimeError(f"{self!r}: unshard requested while already unsharded")
        parts: list[Array] = []
        for spec in self.params:
            data = self.backend.to_host(spec.param, copy=False)
            if tuple(data.shape) != spec.shard_shape:
                name = self.backend.parameter_name(spec.param)
                raise ValueError(
                    f"parameter {name!r} has shape {tuple(data.shape)} between "
                    f"uses; a sharded parameter must keep its shard shape {spec.shard_shape}"
                )
            parts.append(np.ascontiguousarray(data, dtype=spec.dtype).reshape(-1).view(np.uint8))
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
        self._snapshot = flat
        return flat

    def install_full(self, gathered: Sequence[Array]) -> None:
        """Install the full parameters from every member's snapshot (in dp order)."""
        if self._snapshot is None:
            raise RuntimeError(f"{self!r}: install_full without a snapshot (no unshard)")
        if len(gathered) != self.mesh.dp:
            raise ValueError(f"expected {self.mesh.dp} gathered shards, got {len(gathered)}")
        offset = 0
        for spec in self.params:
            nbytes = spec.shard_nbytes
            shards = [g[offset : offset + nbytes].view(spec.dtype) for g in gathered]
            self.backend.set_parameter_data(spec.param, spec.join(shards))
            offset += nbytes

    def reshard(self) -> None:
        """Install the kept shards again; the full tensors are dropped. Idempotent."""
        snapshot = self._snapshot
        if snapshot is None:
            return
        offset = 0
        for spec in self.params:
            nbytes = spec.shard_nbytes
            shard = snapshot[offset : offset + nbytes].view(spec.dtype).reshape(spec.shard_shape)
            self.backend.set_parameter_data(spec.param, shard)
            offset += nbytes
        self._snapshot = None

    def resident_bytes(self) -> int:
        """Measured: bytes of the distinct storages behind the parameters, plus the kept
        shard while unsharded."""
        seen: dict[int, int] = {}
        for param in [spec.param for spec in self.params] + list(self.kept):
            storage = self.backend.storage_of(param)
            seen[storage.ptr] = storage.nbytes
        kept = 0 if self._snapshot is None else int(self._snapshot.nbytes)
        return sum(seen.values()) + kept

    # -- gradients ----------------------------------------------------------------------------
    def grad_buckets(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> list[GradBucket]:
        """Split full-shaped ``grads`` (aligned with ``params``) into per-member flat
        contributions, one bucket per dtype, in first-seen order (compute thread). Kept
        (expert) parameters are left out (``kept_grads``)."""
        if len(params) != len(grads):
            raise ValueError(f"got {len(grads)} gradients for {len(params)} parameters")
        dp = self.mesh.dp
        order: list[str] = []
        members: dict[str, list[list[Array]]] = {}
        indices: dict[str, list[int]] = {}
        for index, (param, grad) in enumerate(zip(params, grads, strict=True)):
            if self.is_kept(param):
                continue
            spec = self.spec_of(param)
            array = self.backend.to_host(grad, copy=False)
            if tuple(array.shape) != spec.full_shape:
                name = self.backend.parameter_name(param)
                raise ValueError(
                    f"gradient of {name!r} has shape {tuple(array.shape)}, expected the "
                    f"full shape {spec.full_shape}"
                )
            key = array.dtype.str
            if key not in members:
                order.append(key)
                members[key] = [[] for _ in range(dp)]
                indices[key] = []
            indices[key].append(index)
            for member, shard in zip(members[key], spec.split(array, dp), strict=True):
                member.append(shard.reshape(-1))
        return [
            GradBucket(
                dtype=key,
                indices=tuple(indices[key]),
                contributions=tuple(np.concatenate(parts) for parts in members[key]),
            )
            for key in order
        ]

    def kept_grads(self, params: Sequence[Tensor], grads: Sequence[Tensor]) -> dict[int, Array]:
        """The gradients of the kept (expert) parameters among ``params``, by index, as
        host copies (compute thread)."""
        return {
            index: np.array(self.backend.to_host(grad, copy=True))
            for index, (param, grad) in enumerate(zip(params, grads, strict=True))
            if self.is_kept(param)
        }

    def shard_grads(
        self,
        params: Sequence[Tensor],
        buckets: Sequence[GradBucket],
        sums: Sequence[Array],
        kept: dict[int, Array] | None = None,
    ) -> tuple[Tensor, ...]:
        """This replica's shard gradients from the reduce-scatter ``sums`` (one per bucket)
        and the kept parameters' gradients ``kept`` (summed over the expert replica
        group), all divided by ``dp`` (the mean over replicas), aligned with ``params``."""
        dp = self.mesh.dp
        out: list[Tensor | None] = [None] * len(params)
        for index, total in (kept or {}).items():
            grad = np.divide(total, total.dtype.type(dp))
            out[index] = self.backend.from_host(grad, like=params[index])
        for bucket, total in zip(buckets, sums, strict=True):
            offset = 0
            for index in bucket.indices:
                spec = self.spec_of(params[index])
                size = math.prod(spec.shard_shape)
                part = total[offset : offset + size].reshape(spec.shard_shape)
                grad = np.divide(part, part.dtype.type(dp))  # in its dtype (bfloat16 too)
                out[index] = self.backend.from_host(grad, like=params[index])
                offset += size
        missing = [self.backend.parameter_name(params[i]) for i, g in enumerate(out) if g is None]
        if missing:
            raise ValueError(f"no reduced gradient for parameters {missing}")
        return tuple(grad for grad in out if grad is not None)


def fsdp_state_of(module: object) -> FsdpState | None:
    """The FsdpState ``fully_shard`` attached to ``module``, or None."""
    state = getattr(module, _STATE_ATTR, None)
    return state if isinstance(state, FsdpState) else None


def fully_shard(module: Module, *, mesh: DeviceMesh, dp_rank: int | None = None) -> Module:
    """Shard every parameter of ``module`` along dim 0 across ``mesh.dp`` replicas.

    ``dp_rank`` is the replica this module copy belongs to (required when ``mesh.dp > 1``;
    module docstring). Returns ``module`` itself, sharded in place. Refuses a module (or a
    submodule, or a parameter) that is already sharded.
    """
    backend = backend_for(module)
    if not backend.is_module(module):
        raise TypeError(
            f"module must be a mindspore.nn.Cell or a torch.nn.Module, got {type(module).__name__}"
        )
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a ppswap.DeviceMesh, got {type(mesh).__name__}")
    if dp_rank is None:
        if mesh.dp != 1:
            raise ValueError(
                f"dp_rank must be given when mesh.dp > 1 (got mesh={mesh!r}, dp_rank=None): "
                f"every dp replica holds its own module copy; pass 0..{mesh.dp - 1}"
            )
        dp_rank = 0
    if not isinstance(dp_rank, int) or isinstance(dp_rank, bool):
        raise TypeError(f"dp_rank must be an int in 0..{mesh.dp - 1}, got {dp_rank!r}")
    if not 0 <= dp_rank < mesh.dp:
        raise ValueError(f"dp_rank must be in 0..{mesh.dp - 1} for {mesh!r}, got {dp_rank!r}")
    for name, cell in backend.submodules(module):
        existing = fsdp_state_of(cell)
        if existing is not None:
            where = "module" if not name else f"submodule {name!r}"
            raise ValueError(
                f"{where} is already fully_shard()-ed ({existing!r}); a module is sharded "
                "once, with one mesh"
            )
    experts = expert_parameter_ids(sub for _, sub in backend.submodules(module))
    everything = backend.all_parameters(module)
    kept = tuple(param for param in everything if id(param) in experts)
    params = [param for param in everything if id(param) not in experts]
    for param in params:
        if getattr(param, _PARAM_MARK, False):
            raise ValueError(
                f"parameter {backend.parameter_name(param)!r} is already sharded by another "
                "fully_shard() call (a module sharded twice, or a parameter shared with a "
                "sharded module)"
            )
    specs: list[ShardedParameter] = []
    for param in params:
        data = backend.to_host(param, copy=True)
        full_rows = data.shape[0] if data.ndim else 1
        spec = ShardedParameter(
            param=param,
            full_shape=tuple(data.shape),
            rows=-(-full_rows // mesh.dp),
            dtype=data.dtype,
        )
        shard = spec.split(data, mesh.dp)[dp_rank]
        backend.set_parameter_data(param, shard)
        setattr(param, _PARAM_MARK, True)
        specs.append(spec)
    setattr(module, _STATE_ATTR, FsdpState(backend, mesh, dp_rank, tuple(specs), kept))
    return module


def _by_dp_rank(modules: Sequence[Module]) -> list[tuple[FsdpState, Module]]:
    """``(state, module)`` of one stage's dp replicas, sorted by dp rank (checked)."""
    pairs: list[tuple[FsdpState, Module]] = []
    for module in modules:
        state = fsdp_state_of(module)
        if state is None:
            raise ValueError(f"every replica must be fully_shard()-ed, got {type(module).__name__}")
        pairs.append((state, module))
    pairs.sort(key=lambda pair: pair[0].dp_rank)
    ranks = [state.dp_rank for state, _ in pairs]
    meshes = {state.mesh for state, _ in pairs}
    dp = pairs[0][0].mesh.dp if pairs else 0
    if not pairs or len(meshes) != 1 or ranks != list(range(dp)):
        raise ValueError(
            f"replicas must be the dp replicas 0..{max(dp - 1, 0)} of one stage, sharded with "
            f"one mesh; got dp ranks {ranks} and meshes {sorted(map(repr, meshes))}"
        )
    return pairs


def full_parameters(replicas: Sequence[Module]) -> list[Array]:
    """The full trainable parameters of one stage, joined from its ``dp`` sharded module
    copies (any order); aligned with the trainable parameters. Not during a run."""
    pairs = _by_dp_rank(replicas)
    backend = pairs[0][0].backend
    columns = zip(*(backend.trainable_parameters(module) for _, module in pairs), strict=True)
    return [
        pairs[0][0].spec_of(params[0]).join([backend.to_host(p, copy=True) for p in params])
        for params in columns
    ]


def full_gradients(replicas: Sequence[PipelineStage]) -> list[Array]:
    """The full gradients of one stage, joined from its ``dp`` replicas' shard gradients
    (``stage.grads`` after a run; replicas in any order); aligned with
    ``trainable_params()``."""
    stages = {id(stage.module): stage for stage in replicas}
    pairs = _by_dp_rank([stage.module for stage in replicas])
    ordered = [stages[id(module)] for _, module in pairs]
    grads = [[stage.backend.to_host(g, copy=True) for g in stage.grads] for stage in ordered]
    state = pairs[0][0]
    return [
        state.spec_of(param).join([replica[index] for replica in grads])
        for index, param in enumerate(ordered[0].parameters)
    ]


async def gather_full_gradients(stage: PipelineStage, transport: object) -> list[Array]:
    """Across processes: the full gradients of ``stage``, joined from the shard gradients
    of every dp replica of it; aligned with ``trainable_params()``, equal to what
    ``full_gradients`` gives for the same replicas in one process.

    ``stage`` is this process's replica (``fully_shard()``-ed with dp_rank
    ``transport.rank // mesh.pp``), after a run. ``transport`` is the run's multi-process
    transport with collectives (``MPITransport``, ``TorchDistTransport``). A collective
    call: every member of the stage's dp group (``mesh.dp_group(transport.rank)``) calls
    it for the same stage, in the same order; the shard gradients of a stage go in one
    ``all_gather``.
    """
    state = fsdp_state_of(stage.module)
    if state is None:
        raise ValueError(
            f"stage {stage.stage_index} must be fully_shard()-ed, got an unsharded one"
        )
    if not (
        isinstance(transport, MultiProcessTransport) and isinstance(transport, AllGatherTransport)
    ):
        raise TypeError(
            "transport must be a multi-process transport with collectives (MPITransport, "
            f"TorchDistTransport), got {type(transport).__name__}"
        )
    mesh, rank = state.mesh, transport.rank
    if transport.world_size != mesh.world_size or mesh.coords(rank).dp != state.dp_rank:
        raise ValueError(
            f"stage {stage.stage_index} is dp replica {state.dp_rank} of mesh={mesh!r}; world "
            f"rank {rank} of {transport.world_size} holds replica {rank // mesh.pp} of a mesh of "
            f"{mesh.world_size} ranks (world rank w is pipeline rank w % pp of replica w // pp)"
        )
    specs = [state.spec_of(param) for param in stage.parameters]
    grads = list(stage.grads)
    if len(grads) != len(specs):
        raise ValueError(
            f"stage {stage.stage_index} has {len(grads)} gradients for {len(specs)} trainable "
            "parameters: gather after a training run"
        )
    parts: list[Array] = []
    for spec, grad in zip(specs, grads, strict=True):
        host = np.ascontiguousarray(state.backend.to_host(grad, copy=True), dtype=spec.dtype)
        if host.nbytes != spec.shard_nbytes:
            name = state.backend.parameter_name(spec.param)
            raise ValueError(
                f"the gradient of {name!r} has shape {host.shape}; a shard gradient has the "
                f"shard's shape {spec.shard_shape}"
            )
        parts.append(host.reshape(-1).view(np.uint8))
    flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint8)
    key = f"full_grads.s{stage.stage_index}"
    gathered = await transport.all_gather(rank, mesh.dp_group(rank), key, flat)
    joined: list[Array] = []
    offset = 0
    for spec in specs:
        end = offset + spec.shard_nbytes
        joined.append(spec.join([g[offset:end].view(spec.dtype) for g in gathered]))
        offset = end
    return joined
