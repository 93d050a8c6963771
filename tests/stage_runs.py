"""What a finished run may leave of its stages' runs: nothing that holds a chunk.

A run's ``StageRun`` objects (``ppswap.stage_run``) hold the records of forwards waiting
for their backward; the runtime drops them at the run's end (a failed run's after
releasing those records). A StageRun may outlive its run while an exception's traceback
refers to it, but none may still hold a chunk. Used by the MindSpore and torch tests.
"""

from __future__ import annotations

import gc

from ppswap.stage_run import StageRun


def stage_runs_holding_chunks() -> int:
    """How many ``StageRun`` objects in the process still hold a recorded chunk."""
    gc.collect()
    return sum(1 for obj in gc.get_objects() if type(obj) is StageRun and obj.live_chunks)
