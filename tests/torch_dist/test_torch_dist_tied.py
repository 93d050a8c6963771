"""Tied parameters under torchrun (``scripts/tied.py``): a GPT-2 style model whose head
and embedding are declared copies on the first and the last rank equals the unsplit model
in loss and every gradient, the two holders' tied gradients are the same bits (the same
digest), swap on as off; with three ranks the middle one, which holds no copy, still
takes part in the exchange of declarations."""

from __future__ import annotations

import re

import pytest
from launch import launch

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.slow


def digests(output: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for case, digest in re.findall(r"rank \d+ (\S+) tied ([0-9a-f]+)", output):
        found.setdefault(case.rsplit("-swap-", 1)[0], set()).add(digest)
    return found


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ranks", [2, 3])
def test_tied_copies_sum_across_processes(ranks: int) -> None:
    result = launch(ranks, "tied.py", "torch", timeout_s=180)
    assert result.returncode == 0, result.output
    for rank in range(ranks):
        assert f"rank {rank} OK" in result.output, result.output
    found = digests(result.output)
    assert set(found) == {"1f1b", "interleaved_1f1b"}, result.output
    assert all(len(one) == 1 for one in found.values()), result.output
    # 2 schedules x swap off and on x 2 holders
    assert len(re.findall(r"rank \d+ \S+ tied", result.output)) == 8, result.output
