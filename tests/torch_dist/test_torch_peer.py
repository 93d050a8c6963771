"""ppswap against its peer, torch.distributed.pipelining, one process per rank (gloo).

``scripts/peer_pipelining.py`` under ``torchrun --standalone --nproc_per_node N`` (N = 2
and 4): the same seeded stage modules, batch, micro-batches and loss under
torch.distributed.pipelining (``PipelineStage`` with ``ScheduleGPipe``, ``Schedule1F1B``,
``ScheduleInterleaved1F1B`` at vpp 2) and under ppswap over ``TorchDistTransport``. On
every rank torch runs ppswap's compute order, step for step (recorded from its stages).
Without swap ppswap's per-micro-batch losses equal torch's (rtol 1e-6) and so do the
gradients of every stage on every rank (rtol 1e-5); with swap they are bit-identical to
ppswap without.
The same in bfloat16 (the modules and the batch; below one bfloat16 ulp, so bit for bit).
The launch runs in its own process group with a deadline and is killed whole on timeout.

``benchmarks/bench_torch_peer.py --quick`` (the same comparison timed, in ``make bench``)
and ``benchmarks/bench_torch_overhead.py`` (a few rounds) run end to end and report every
figure; no timing is judged here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed.pipelining")

from launch import REPO, launch

pytestmark = pytest.mark.slow

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
CASES = (*SCHEDULES, *(f"{schedule}-bf16" for schedule in SCHEDULES))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ranks", [2, 4])
def test_losses_and_gradients_equal_torch_pipelining(ranks: int) -> None:
    result = launch(ranks, "peer_pipelining.py", *CASES, timeout_s=170)
    assert result.returncode == 0, result.output
    assert "MISMATCH" not in result.output, result.output
    for case in CASES:
        stage_num = 2 * ranks if case.startswith("interleaved_1f1b") else ranks
        grads = 6 * 2 * stage_num // ranks  # 2 blocks of 6 parameter tensors per stage
        steps = 2 * 8 * stage_num // ranks  # a forward and a backward per micro-batch and stage
        for rank in range(ranks):
            losses = "8 losses (bit-identical|equal)" if rank == ranks - 1 else "losses not held"
            pattern = (
                rf"rank {rank} OK: {case} pp{ranks} stages {stage_num}: torch's order is "
                rf"ppswap's \({steps} compute steps\), {losses}[^,]*, "
                rf"{grads} gradients equal .*?, swap on = off"
            )
            assert re.search(pattern, result.output), (pattern, result.output)


@pytest.mark.timeout(300)
def test_quick_benchmark_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "peer.json"
    # the benchmark kills its own torchrun job (a process group of its own) at 240 s
    script = "benchmarks/bench_torch_peer.py"
    command = [sys.executable, script, "--quick", "--json", str(out), "--timeout-s", "240"]
    command += ["--swap-min-bytes", "4096"]  # LayerNorm statistics stay: the cuts below hold
    command += ["--swap-policy", "peak"]
    cpus = sorted(os.sched_getaffinity(0))
    command += ["--cores", str(len(cpus))]  # every CPU: the flag's path, no slowdown
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=270)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"bench_torch_peer.py --quick hung:\n{output}")
    assert process.returncode == 0, output
    report = json.loads(out.read_text())
    assert report["pp"] == 2 and report["quick"] and report["swap_min_bytes"] == 4096
    assert report["swap_policy"] == "peak"
    assert report["cpus"] == cpus and report["cores"] == len(cpus)
    assert '(p2p plain, swap_policy "peak", swap_min_bytes=4096);' in output
    assert [r["schedule"] for r in report["summary"]] == ["GPipe", "1F1B", "Interleaved vpp2"]
    for row in report["summary"]:
        assert all(row["median_s"][c] > 0 for c in ("torch", "ppswap", "ppswap+swap"))
        assert row["ppswap/torch"] > 0 and row["ppswap+swap/torch"] > 0
        # where ppswap's step goes: compute-thread time by kind, the copy threads' busy time
        plain, swapped = row["thread_median_s"]["ppswap"], row["thread_median_s"]["ppswap+swap"]
        assert plain["forward"] > 0 and plain["backward"] > 0, row["schedule"]
        assert plain["swap_prepare"] == plain["swap_finish"] == plain["copy"] == 0.0
        assert plain["exposed_wait"] == 0.0 and swapped["exposed_wait"] >= 0.0
        if row["schedule"] == "GPipe":  # most chunks are swapped
            assert min(swapped[p] for p in ("swap_prepare", "swap_finish", "copy")) > 0, swapped
    for result in report["results"]:
        assert result["losses_equal"] and result["swap_bit_identical"], result["schedule"]
        assert [r["rank"] for r in result["ranks"]] == [0, 1]
        for rank in result["ranks"]:
            # counted the same way, the two hold the same bytes without swap
            assert rank["torch_peak"] == rank["ppswap_peak"] > 0, (result["schedule"], rank)
            assert rank["swap_peak"] <= rank["ppswap_peak"]
        if result["schedule"] == "GPipe":  # the peak plan swaps 6 of 8: the cut is real
            assert [r["eligible"] for r in result["ranks"]] == [6, 6]
            assert [(r["chunks_no_swap"], r["chunks_swap"]) for r in result["ranks"]] == [
                (8, 3)
            ] * 2
            assert all(r["swap_peak"] < r["ppswap_peak"] for r in result["ranks"])
    assert report["headline"].startswith("Against torch.distributed.pipelining (pp2")
    assert "| GPipe pp2 m8 |" in output and report["headline"] in output
    assert "| GPipe | ppswap+swap |" in output


@pytest.mark.timeout(200)
def test_overhead_benchmark_splits_both_contenders_into_per_micro_and_fixed_costs(
    tmp_path: Path,
) -> None:
    out = tmp_path / "overhead.json"
    script = "benchmarks/bench_torch_overhead.py"
    command = [sys.executable, script, "--rounds", "3", "--warmup", "1", "--json", str(out)]
    command += ["--timeout-s", "150"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["micros"] == [2, 16] and report["rounds"] == 3
    for contender in ("torch", "ppswap"):
        times = [report["times_s"][m][contender] for m in ("2", "16")]
        assert all(len(t) == 3 and min(t) > 0 for t in times)
        row = report["fit"][contender]
        # the line goes through both medians (no timing is judged)
        assert row["fixed_ms"] + 2 * row["per_micro_ms"] == pytest.approx(row["m2_ms"])
        assert row["fixed_ms"] + 16 * row["per_micro_ms"] == pytest.approx(row["m16_ms"])
    assert "| ppswap |" in result.stdout and "ppswap over torch:" in result.stdout


def test_benchmark_refuses_more_cores_than_it_may_use() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    for value in (len(cpus) + 1, 0):
        message = f"--cores must be in 1..{len(cpus)} (the CPUs this process may use: {cpus}), "
        message += f"got {value}"
        result = subprocess.run(
            [sys.executable, "benchmarks/bench_torch_peer.py", "--cores", str(value)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and message in result.stderr, result.stderr
