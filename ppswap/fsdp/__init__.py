"""FSDP for pipeline stages: ``fully_shard``, the DP x PP ``DeviceMesh``, and the
UNSHARD / RESHARD work the runtime runs for the scheduler's FSDP steps.

See ``docs/fsdp.md``. ``mesh`` (layout), ``shard`` (the parameter shards and their
moves), ``driver`` (one rank's FSDP steps, collectives through the P2P actor), ``plan``
(checks and per-world-rank pieces of a run).
"""

from ppswap.fsdp.driver import FsdpRankDriver, FsdpStats
from ppswap.fsdp.mesh import DeviceMesh, MeshCoords, order_for_world_rank
from ppswap.fsdp.shard import (
    FsdpState,
    ShardedParameter,
    fsdp_state_of,
    full_gradients,
    full_parameters,
    fully_shard,
    gather_full_gradients,
)

__all__ = [
    "DeviceMesh",
    "FsdpRankDriver",
    "FsdpState",
    "FsdpStats",
    "MeshCoords",
    "ShardedParameter",
    "fsdp_state_of",
    "full_gradients",
    "full_parameters",
    "fully_shard",
    "gather_full_gradients",
    "order_for_world_rank",
]
