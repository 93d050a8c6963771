"""The heap a job trains on: what was alive when its steps began kept out of the cyclic
collector's full passes while they run.

A full (generation 2) collection scans every tracked object in the process: with a
tensor framework imported and a model built, that is hundreds of thousands of objects,
and each pass held the GIL 35-125 ms in the middle of a job's steps (measured in
``ppswap serve`` training the torch demo LM), stalling every request the server answered
meanwhile. ``gc.freeze`` moves the objects alive at the job's start (the framework's
modules, the model) into the permanent generation, so the passes during the job scan
only what the job made since; ``gc.unfreeze`` hands them back when the job ends, where
the next full pass sees them again (nothing frozen is lost to the collector for good).

``gc.unfreeze`` hands back every frozen object, not only those frozen here: where the
process froze objects already (``gc.get_freeze_count() > 0``: a host application or a
test session that manages its heap this way), the process owns the freezing and this
does nothing.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["heap_frozen"]


@contextmanager
def heap_frozen() -> Iterator[None]:
    """Freeze the objects alive now for the duration of the block; unfreeze on exit,
    whether it raised or not. Does nothing where objects are frozen already (module
    docstring), so a nested use leaves the outer one in place."""
    if gc.get_freeze_count() > 0:
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
