"""Expert parallelism: ``expert_parallel`` splits a module's MoE blocks' experts over the
EP group of a ``DeviceMesh``; ``ExpertExchange`` is a rank's all-to-all, posted from the
compute thread to its P2P actor. Framework-free: the MoE blocks themselves are in
``ppswap.backends.<framework>.moe``. See ``docs/moe.md``.
"""

from ppswap.moe.exchange import AllToAll, ExpertExchange, LocalExchange
from ppswap.moe.split import (
    ExpertBlock,
    ExpertParallelState,
    check_expert_stages,
    expert_blocks,
    expert_parallel,
    expert_state_of,
    is_expert_block,
)

__all__ = [
    "AllToAll",
    "ExpertBlock",
    "ExpertExchange",
    "ExpertParallelState",
    "LocalExchange",
    "check_expert_stages",
    "expert_blocks",
    "expert_parallel",
    "expert_state_of",
    "is_expert_block",
]
