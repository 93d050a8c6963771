"""The async service example works end to end (``examples/async_service.py --self-test``).

It trains with an SGD step per run while a watcher task consumes the runs' events, cancels
a step at its first offload, runs it again and checks that the losses equal those of an
uninterrupted training with no ppswap thread left; it exits non-zero if any of that fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.mindspore]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "async_service.py"


@pytest.mark.timeout(400)
def test_async_service_self_test_passes() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE), "--self-test"],
        capture_output=True,
        text=True,
        timeout=360,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "self-test passed" in done.stdout
    assert "cancelled and torn down" in done.stdout
    assert done.stdout.count("RankMetrics(rank=") == 4 * 6  # 4 ranks, 6 runs finished
