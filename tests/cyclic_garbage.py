"""What the garbage collector sees of ppswap: objects in reference cycles, and objects a
chunk keeps alive long enough to reach the oldest generation.

A run's actors, swap groups and chunk records must be freed by reference counting when
the run is over (the next collection may be many steps away, and a cycle that holds a
chunk's records holds what they refer to until then). And every tracked object a swapped
chunk keeps from its forward to its backward outlives the young collections, so the full
ones (which walk the whole process) come sooner the more there are. Used by the MindSpore
and the torch tests alike.
"""

from __future__ import annotations

import gc
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

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


@dataclass
class Promoted:
    """How many tracked objects the block of :func:`promoted` left in the oldest
    generation (set when the block ends)."""

    count: int = 0


@contextmanager
def promoted() -> Iterator[Promoted]:
    """The block runs with the collector off, after one collection; then a young
    collection (generations 0 and 1) moves what the block keeps alive into the oldest
    generation, and the count of it is what the block promoted."""
    found = Promoted()
    with collector_off():
        before = len(gc.get_objects(generation=2))
        yield found
        gc.collect(1)
        found.count = len(gc.get_objects(generation=2)) - before
