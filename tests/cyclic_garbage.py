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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from ppswap.backends.base import Backend
from ppswap.scheduler.lowering import collector_paused
from ppswap.swap import EmulatedDevice, PipelineSwapSession, SwapManager, module_state_tensors


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


def promoted_by_one_chunk(backend: Backend, module: Any, x: Any, *, swap: bool) -> tuple[int, int]:
    """What :func:`promoted` counts for one chunk of ``module`` (a stage) on input ``x`` in a
    swap session of ``backend``: its forward and, with ``swap``, its offload and load
    (what the chunk keeps until its backward); and how many storages it moved. The
    backward and the release run after the count."""
    session = PipelineSwapSession(
        SwapManager(backend),
        EmulatedDevice(),
        rank=0,
        generation=1,
        eligible={(0, 0)} if swap else set(),
        count_saved=swap,
    )
    state = module_state_tensors(module)
    with promoted() as kept:
        with session.collection_context(0, 0, protected=[x], parameters=state):
            out, record = backend.autograd.record(module, (x,))
        moved = 0
        if swap:
            session.prepare_offload(0, 0).run()
            session.finish_offload(0, 0)
            session.prepare_load(0, 0).run()
            session.finish_load(0, 0)
            moved = len(session.manager.get_group(session.group_name(0, 0)).spans())
    seed = backend.from_host(np.ones(backend.shape_of(out), np.float32), like=out)
    backend.autograd.backward(record, seed, backend.trainable_parameters(module))
    session.release_chunk(0, 0)
    session.close()
    return kept.count, moved


def swap_tracked_per_storage(backend: Backend, build: Callable[[], Any], x: Any) -> float:
    """Tracked objects a swapped chunk of a stage made by ``build`` keeps until its
    backward beyond what the same chunk keeps without swap, per storage moved (after one
    swapped chunk that fills the caches and pools)."""
    promoted_by_one_chunk(backend, build(), x, swap=True)
    plain, _ = promoted_by_one_chunk(backend, build(), x, swap=False)
    swapped, moved = promoted_by_one_chunk(backend, build(), x, swap=True)
    assert moved > 0
    return (swapped - plain) / moved
