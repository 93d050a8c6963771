"""Activation capture and the D2H/H2D state machine of saved tensors (see docs/swap.md).

Selection (``swap_wrapper``, ``swap_tensor_wrapper``) is the user's; timing is the
pipeline schedule's, executed through a :class:`PipelineSwapSession` per run and rank.
"""

from ppswap.backends.base import CopyEngine
from ppswap.backends.cpu_engine import EmulatedDevice
from ppswap.swap.errors import SwapError, SwapStateError, SwapTimeoutError, SwapWarning
from ppswap.swap.group import SwapGroup
from ppswap.swap.jobs import CopyJob
from ppswap.swap.manager import SwapManager
from ppswap.swap.recompute import recompute_wrapper
from ppswap.swap.session import PipelineSwapSession, SwapStats
from ppswap.swap.tensor import CheckMode, Storage, SwapState, SwapTensor
from ppswap.swap.wrappers import module_state_tensors, swap_tensor_wrapper, swap_wrapper

__all__ = [
    "CheckMode",
    "CopyEngine",
    "CopyJob",
    "EmulatedDevice",
    "PipelineSwapSession",
    "Storage",
    "SwapError",
    "SwapGroup",
    "SwapManager",
    "SwapState",
    "SwapStateError",
    "SwapStats",
    "SwapTensor",
    "SwapTimeoutError",
    "SwapWarning",
    "module_state_tensors",
    "recompute_wrapper",
    "swap_tensor_wrapper",
    "swap_wrapper",
]
