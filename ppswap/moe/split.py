"""``expert_parallel``: keep one EP rank's share of a module's experts.

A MoE block (``ExpertBlock``, implemented by ``ppswap.backends.<framework>.moe.MoE``)
holds ``num_experts`` experts as stacked weights and computes with all of them until
``expert_parallel(module, mesh=mesh, dp_rank=d)`` keeps, in every MoE block of
``module``, the experts ``r * n .. r * n + n - 1`` of EP rank ``r = d % mesh.ep``
(``n = num_experts // mesh.ep``): the stacked weights are sliced in place, the others'
storage released. Tokens then reach their expert over the EP group by all-to-all (the
block's ``exchange``, bound by the runtime for a run). Like ``fully_shard``, in-process
runs hold every replica's copy, so ``dp_rank`` says which replica this copy is; every
replica must be built with the same initial weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ppswap.backends import backend_for
from ppswap.backends.types import Module
from ppswap.core.all_to_all import ExpertBlock, is_expert_block
from ppswap.fsdp.mesh import DeviceMesh
from ppswap.fsdp.shard import fsdp_state_of
from ppswap.stage import PipelineStage

__all__ = [
    "ExpertBlock",
    "ExpertParallelState",
    "check_expert_stages",
    "expert_blocks",
    "expert_parallel",
    "expert_state_of",
    "is_expert_block",
]

_STATE_ATTR = "_ppswap_expert_parallel"


def expert_blocks(module: Module) -> list[ExpertBlock]:
    """Every MoE block of ``module`` (itself included), in the backend's module order."""
    backend = backend_for(module)
    blocks = [sub for _, sub in backend.submodules(module) if is_expert_block(sub)]
    if is_expert_block(module) and not any(b is module for b in blocks):
        blocks.insert(0, module)
    return blocks


@dataclass(frozen=True, slots=True)
class ExpertParallelState:
    """What ``expert_parallel`` did to a module: its mesh, dp replica, EP rank and blocks."""

    mesh: DeviceMesh
    dp_rank: int
    blocks: tuple[ExpertBlock, ...]

    @property
    def ep_rank(self) -> int:
        return self.dp_rank % self.mesh.ep

    def expert_parameter_ids(self) -> frozenset[int]:
        """``id`` of every expert parameter the module keeps."""
        return frozenset(id(p) for block in self.blocks for p in block.expert_parameters())


def expert_state_of(module: object) -> ExpertParallelState | None:
    """The state ``expert_parallel`` left on ``module``, or None."""
    state = getattr(module, _STATE_ATTR, None)
    return state if isinstance(state, ExpertParallelState) else None


def _check_index(name: str, value: object, bound: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < bound:
        raise ValueError(f"{name} must be an int in 0..{bound - 1}, got {value!r}")
    return value


def expert_parallel(module: Module, *, mesh: DeviceMesh, dp_rank: int) -> Module:
    """Keep EP rank ``dp_rank % mesh.ep``'s experts in every MoE block of ``module``
    (module docstring); returns ``module``. Refuses a module without a MoE block, one
    already split, and a block whose ``num_experts`` ``mesh.ep`` does not divide."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a ppswap.DeviceMesh, got {type(mesh).__name__}")
    _check_index("dp_rank", dp_rank, mesh.dp)
    if expert_state_of(module) is not None:
        raise ValueError("module was already split by expert_parallel (call it once per module)")
    blocks = expert_blocks(module)
    if not blocks:
        raise ValueError(
            f"module has no MoE block for expert_parallel to split (a "
            f"ppswap.backends.<framework>.moe.MoE), got {type(module).__name__}"
        )
    for block in blocks:
        if block.num_experts % mesh.ep:
            raise ValueError(
                f"num_experts must be a multiple of mesh.ep={mesh.ep} to split the experts "
                f"evenly, got num_experts={block.num_experts}"
            )
        if block.kept_experts != (0, block.num_experts):
            raise ValueError("a MoE block of module already keeps only some of its experts")
    ep_rank = dp_rank % mesh.ep
    for block in blocks:
        count = block.num_experts // mesh.ep
        block.keep_experts(ep_rank * count, count)
    setattr(module, _STATE_ATTR, ExpertParallelState(mesh, dp_rank, tuple(blocks)))
    return module


def check_expert_stages(
    stages: Sequence[PipelineStage], mesh: DeviceMesh | None, *, one_process: bool
) -> None:
    """Before a run: under a mesh with ``ep > 1`` every stage whose module holds MoE
    blocks must be ``expert_parallel``-ed with that mesh, as the dp replica it is
    ``fully_shard``-ed as; a stage split by ``expert_parallel`` needs such a mesh. With
    every rank in ``one_process``, MindSpore stages cannot be split (their autograd cannot
    record the interleaved forwards of ranks sharing the compute thread)."""
    for stage in stages:
        state = expert_state_of(stage.module)
        where = f"stage {stage.stage_index}"
        if mesh is None or mesh.ep == 1:
            if state is not None and state.mesh.ep > 1:
                raise ValueError(
                    f"{where} was split by expert_parallel with mesh={state.mesh!r}, but the "
                    f"run's mesh is {mesh!r}: fully_shard every stage with that mesh"
                )
            continue
        if not expert_blocks(stage.module):
            continue
        if state is None:
            raise ValueError(
                f"{where} holds MoE blocks but was not split by expert_parallel: call "
                f"ppswap.moe.expert_parallel(module, mesh={mesh!r}, dp_rank=...) for mesh.ep="
                f"{mesh.ep}"
            )
        if one_process and not all(b.runs_in_fibers for b in expert_blocks(stage.module)):
            raise ValueError(
                f"{where}: MindSpore stages run expert parallelism with one process per "
                f"rank (transport=MPITransport(...)), not every rank in one process: its "
                f"autograd cannot record two ranks' forwards interleaved; got mesh={mesh!r}"
            )
        fsdp = fsdp_state_of(stage.module)
        dp_rank = None if fsdp is None else fsdp.dp_rank
        if state.mesh != mesh or state.dp_rank != dp_rank:
            raise ValueError(
                f"{where} was split by expert_parallel with mesh={state.mesh!r}, "
                f"dp_rank={state.dp_rank}; the run's mesh is {mesh!r} and the stage is dp "
                f"replica {dp_rank}"
            )
