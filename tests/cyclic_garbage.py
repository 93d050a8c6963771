"""What a finished run leaves to the garbage collector: ppswap objects in reference cycles.

A run's actors, swap groups and chunk records must be freed by reference counting when
the run is over (the next collection may be many steps away, and a cycle that holds a
chunk's records holds what they refer to until then). Used by the MindSpore and the torch
tests alike.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from ppswap.scheduler.lowering import collector_paused


@contextmanager
def collector_off() -> Iterator[None]:
    """The block runs with the garbage collector off, after one collection (what the block
    leaves unreachable stays for :func:`ppswap_cyclic_garbage` to find); the collector's
    state is restored after."""
    gc.collect()
    with collector_paused():
        yield


def ppswap_cyclic_garbage() -> Counter[str]:
    """Collect once, keeping what was unreachable; return how many objects of each ppswap
    type it held (empty: nothing of ppswap needed the collector)."""
    flags = gc.get_debug()
    gc.set_debug(flags | gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        found = Counter(
            f"{type(obj).__module__}.{type(obj).__qualname__}"
            for obj in gc.garbage
            if type(obj).__module__.startswith("ppswap")
        )
    finally:
        gc.garbage.clear()
        gc.set_debug(flags)
    return found
