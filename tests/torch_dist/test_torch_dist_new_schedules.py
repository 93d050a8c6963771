"""Looped BFS, Interleaved Zero Bubble, ZBV, DualPipeV and a given order under ``torchrun``
(2 processes, gloo), with ``scripts/pipeline.py``'s checks: swap on bit-identical to swap
off, both equal to one unsplit torch model, bytes moved exactly where the plan swaps, and
every rank's gradients bit-identical to the same run in one process.

Each family runs once, the P2P mode rotating; the V schedules place stages 0 and 3 on rank
0 and stages 1 and 2 on rank 1, which hands its first-leg output to itself at the V's turn.
``vorder`` is an order written in torch's action notation (V placement, the first leg's
backwards split with their weights deferred to the end) and run with ``order=``.
"""

from __future__ import annotations

import pytest
from launch import launch
from test_torch_dist_pipeline import ok_lines

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.slow

CASES = [
    "looped_bfs-plain",
    "interleaved_zb-batch",
    "zbv-boundary",
    "dualpipev-plain",
    "vorder-batch",
]


@pytest.mark.timeout(240)
def test_new_schedules_match_swap_off_unsplit_and_in_process() -> None:
    result = launch(2, "pipeline.py", *CASES, timeout_s=200)
    assert result.returncode == 0, result.output
    assert "MISMATCH" not in result.output, result.output
    swapped = set()
    for rank in range(2):
        reported = ok_lines(result, rank)
        assert sorted(reported) == sorted(CASES), result.output
        swapped |= {case for case, rest in reported.items() if "offloaded=0 " not in rest}
    assert swapped == set(CASES)  # every case moved activations on some rank
