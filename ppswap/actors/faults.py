"""Deprecated: fault plans moved to ``ppswap.core.faults`` (same names).

Importing this module warns (``DeprecationWarning``) and re-exports them; it will be
removed in a later release.
"""

import warnings

from ppswap.core.faults import (
    FaultAction,
    FaultPlan,
    FaultRule,
    FaultSite,
    InjectedFault,
    call_at,
    delay_compute,
    delay_copy,
    delay_message,
    drop_message,
    fail_compute,
    fail_copy,
    fail_p2p,
)

__all__ = [
    "FaultAction",
    "FaultPlan",
    "FaultRule",
    "FaultSite",
    "InjectedFault",
    "call_at",
    "delay_compute",
    "delay_copy",
    "delay_message",
    "drop_message",
    "fail_compute",
    "fail_copy",
    "fail_p2p",
]

warnings.warn(
    "ppswap.actors.faults moved to ppswap.core.faults; import it from there",
    DeprecationWarning,
    stacklevel=2,
)
