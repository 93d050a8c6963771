"""The async service example works end to end (``examples/async_service.py --self-test``).

Its self-test serves HTTP on loopback, trains in the background, keeps answering while a
run is in flight, cancels a run on request and checks that the next run gives exactly
the same loss with no ppswap thread left; it exits non-zero if any of that fails.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

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
    assert '"runs_cancelled": 1' in done.stdout
