"""The runtime's threads still alive: what the leak checks of the suites compare with none."""

from __future__ import annotations

import threading

OUTLIVING_THREADS = frozenset({"ppswap-torch-dist-wait"})
"""A ``TorchDistTransport``'s waiting thread may outlive its transport, blocked in gloo
until the group's timeout (docs/torch_dist.md, Limits): another test's transport's, not
a run's (an in-process run makes none)."""


def runtime_threads() -> list[str]:
    """Names of the live ``ppswap-`` threads, but for those that may outlive a test."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if t.name.startswith("ppswap-") and t.name not in OUTLIVING_THREADS
    )
