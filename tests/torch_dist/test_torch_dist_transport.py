"""TorchDistTransport across processes: ``torchrun --standalone --nproc_per_node N``.

Each test launches a script from ``tests/torch_dist/scripts`` with torchrun in its own
process group, with a deadline (``launch.py``); on timeout the whole group is killed, so a
hang fails the test instead of leaving stray ranks behind.
"""

from __future__ import annotations

import re
import time

import pytest
from launch import launch

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.slow

ABORT_DEADLINE_S = 10.0


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks", [2, 4])
def test_exchange_is_bit_exact_and_collectives_match_in_process(ranks: int) -> None:
    result = launch(ranks, "exchange.py", timeout_s=120)
    assert result.returncode == 0, result.output
    for rank in range(ranks):
        cases = 16  # scripts/exchange.py's CASES: arrays each rank sends each peer each way
        messages = 2 * cases * (ranks - 1)
        pattern = rf"rank {rank} OK: {messages} messages bit-exact, \d+ collectives equal"
        assert re.search(pattern, result.output), result.output
        assert f"rank {rank} closed: no thread left" in result.output, result.output


@pytest.mark.timeout(150)
def test_one_failing_rank_ends_every_process() -> None:
    ranks = 4
    result = launch(ranks, "fail_one_rank.py", timeout_s=120)
    ended_at = time.time()
    failed = ranks - 1
    assert result.returncode != 0, result.output
    # the runtime's report (abort_job) names the rank and its error
    assert f"ppswap: rank {failed} failed, aborting the job: injected failure" in result.output
    # the others failed only on the lost connection, naming the rank that went away
    for rank in range(failed):
        assert f"ppswap: rank {rank} failed, aborting the job: injected" not in result.output
    # and waited long enough for torchrun to name the first failure as the root cause
    root_cause = result.output.split("Root Cause", 1)[-1]
    assert re.search(rf"rank\s*: {failed} \(local_rank: {failed}\)", root_cause), result.output
    failing = re.search(r"failing at ([0-9.]+)", result.output)
    assert failing is not None, result.output
    assert ended_at - float(failing.group(1)) < ABORT_DEADLINE_S, result.output
