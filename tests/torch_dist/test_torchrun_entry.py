"""torchrun without writing a script: ``ppswap demo --transport torch`` under torchrun, and
``examples/torchrun_pipeline.py``; a world size that does not fit the stages is one line
on each rank that reaches the check before torchrun stops the rest, naming
``--nproc-per-node``, and no traceback of ours (torchrun's own failure summary follows it)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from process_group import REPO, Launch, run_group

pytest.importorskip("torch.distributed")

pytestmark = pytest.mark.slow


def torchrun(ranks: int, *target: str) -> Launch:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc-per-node", str(ranks), *target,
    ]  # fmt: skip
    what = f"torchrun --nproc-per-node {ranks} {' '.join(target)}"
    return run_group(command, env={"OMP_NUM_THREADS": "1"}, timeout_s=240, what=what)


def assert_no_traceback_of_ours(output: str) -> None:
    """Only torchrun's own launcher may print a traceback."""
    frames = re.findall(r'File "([^"]+)"', output)
    assert not [f for f in frames if "/ppswap/" in f or "/examples/" in f], output


@pytest.mark.timeout(300)
def test_the_demo_runs_under_torchrun(tmp_path: Path) -> None:
    result = torchrun(
        2, "-m", "ppswap.cli", "demo", "--transport", "torch", "--pp", "2", "--micro", "4",
        "--batch", "8", "--steps", "2", "--no-plot", "--out", str(tmp_path),
    )  # fmt: skip
    assert result.returncode == 0, result.output
    assert "torch char LM" in result.output
    assert result.output.count("bit-identical: yes") == 1, result.output  # rank 0 reports
    assert re.search(r"^   1 \| +[\d,]+ \| +[\d,]+ \| +[\d.]+%", result.output, re.MULTILINE)
    for rank in (0, 1):
        assert (tmp_path / f"trace_swap_rank{rank}.json").exists()


@pytest.mark.timeout(300)
def test_a_world_size_that_does_not_fit_is_one_line_on_each_rank(tmp_path: Path) -> None:
    example = torchrun(3, str(REPO / "examples" / "torchrun_pipeline.py"))
    assert example.returncode != 0
    # torchrun stops the other ranks when the first one exits, so a loaded host may see
    # fewer than three lines; each rank that prints says the same one line, once.
    errors = re.findall(r"^rank (\d): error: (.*)$", example.output, re.MULTILINE)
    ranks = [rank for rank, _ in errors]
    assert ranks and len(set(ranks)) == len(ranks) and set(ranks) <= {"0", "1", "2"}, example.output
    assert {message for _, message in errors} == {
        "pp=3 comes from the world size (torchrun --nproc-per-node, mpiexec -n); it must "
        "divide stage_num=8 (vpp = stage_num // pp)"
    }
    assert_no_traceback_of_ours(example.output)
    demo = torchrun(
        3, "-m", "ppswap.cli", "demo", "--transport", "torch", "--no-plot", "--out", str(tmp_path)
    )
    assert demo.returncode != 0
    line = (
        "ppswap: error: pp=4 must equal the world size 3 (torchrun --nproc-per-node 3): "
        "launch with torchrun --nproc-per-node 4, or pass --pp 3"
    )
    assert 1 <= demo.output.splitlines().count(line) <= 3, demo.output
    assert_no_traceback_of_ours(demo.output)


@pytest.mark.timeout(300)
def test_the_example_trains_under_torchrun() -> None:
    result = torchrun(2, str(REPO / "examples" / "torchrun_pipeline.py"))
    assert result.returncode == 0, result.output
    # Each line is one write, but another process's unfinished line may precede it.
    losses = [float(v) for v in re.findall(r"step \d: loss ([0-9.]+)$", result.output, re.M)]
    assert len(losses) == 3 and losses[-1] < losses[0], result.output
    offloaded = re.findall(r"rank (\d): stages .* offloaded (\d+) B$", result.output, re.M)
    assert sorted(rank for rank, _ in offloaded) == ["0", "1"], result.output
    assert all(int(moved) > 0 for _, moved in offloaded)
