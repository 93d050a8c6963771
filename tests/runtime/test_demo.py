"""The main job runs end to end (small sizes) and checks itself."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ppswap.cli import main
from ppswap.demo.progress import Progress
from ppswap.demo.report import format_report, step_time_line
from ppswap.demo.run import DemoOptions, run_demo

pytestmark = pytest.mark.slow


@pytest.mark.mindspore
def test_demo_trains_and_swap_agrees(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    report = run_demo(DemoOptions(pp=2, micro=4, batch=8, steps=2, out_dir=tmp_path, plot=False))
    progress = capsys.readouterr().err
    # a line before the first step, so the slow first step does not look like a hang
    assert progress.index("  step 0/2 running...\n") < progress.index("step 1/2")
    assert "\r" not in progress  # not a terminal: one line per step, no bar redrawn
    # the two trainings take each step in turn: both times are there after every step
    for step in (1, 2):
        both = rf"step {step}/2 loss [0-9.]+ \(swap off [0-9.]+s, swap on [0-9.]+s\)"
        assert re.search(both, progress), step
    assert report.losses_no_swap == report.losses_swap
    assert len(report.losses_swap) == 2
    assert report.losses_swap[1] < report.losses_swap[0]  # it trains
    for off, on in zip(report.last_no_swap.ranks, report.last_swap.ranks, strict=True):
        assert on.peak_saved_bytes < off.peak_saved_bytes
    text = format_report(report)
    assert "bit-identical: yes" in text
    legend = text.split("columns (", 1)[1].splitlines()
    for column in (
        "peak saved off/on",
        "cut",
        "chunks off/on (plan)",
        "predicted on",
        "exposed wait",
    ):
        assert sum(line.startswith(f"  {column}  ") for line in legend) == 1, column
    assert len(report.step_times_swap) == 2
    assert "step time (step 2; step 1 warms up): swap off" in text
    assert (tmp_path / "trace_swap.json").exists()


def test_cli_refuses_bad_demo_options(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["demo", "--batch", "6", "--micro", "4"]) == 2
    assert "batch must be divisible by micro=4" in capsys.readouterr().err


def test_torch_demo_trains_and_swap_agrees(tmp_path: Path) -> None:
    opts = DemoOptions(
        pp=2, micro=4, batch=8, steps=2, out_dir=tmp_path, plot=False, backend="torch"
    )
    report = run_demo(opts)
    assert report.losses_no_swap == report.losses_swap  # bit for bit
    assert len(report.losses_swap) == 2
    assert report.losses_swap[1] < report.losses_swap[0]  # it trains
    for off, on in zip(report.last_no_swap.ranks, report.last_swap.ranks, strict=True):
        assert on.offloaded_bytes > 0
        assert on.peak_saved_bytes < off.peak_saved_bytes
    assert "bit-identical: yes" in format_report(report)
    assert (tmp_path / "trace_swap.json").exists()


def test_torch_demo_from_the_console_needs_no_mindspore(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "sys.modules['mindspore'] = None  # importing it now fails\n"
        "from ppswap.cli import main\n"
        "status = main(['demo', '--backend', 'torch', '--pp', '2', '--micro', '2', '--batch', "
        f"'4', '--steps', '1', '--no-plot', '--out', {str(tmp_path)!r}])\n"
        "print('mindspore loaded:', sys.modules.get('mindspore') is not None)\n"
        "sys.exit(status)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "bit-identical: yes" in done.stdout
    assert "mindspore loaded: False" in done.stdout
    assert "torch char LM" in done.stderr
    assert "\r" not in done.stderr  # a pipe, as a log file: no bar redrawn in place
    assert any(line.startswith("  step 1/1 loss ") for line in done.stderr.splitlines())


def test_step_time_line_leaves_out_the_warm_up_step() -> None:
    # step 1 warms up; the median of the others, and on over off
    assert step_time_line([9.0, 1.0, 3.0, 2.0], [9.0, 2.2, 2.0, 6.0]) == (
        "step time (median of steps 2-4; step 1 warms up): swap off 2.00s, swap on 2.20s (1.10x)"
    )
    assert step_time_line([9.0, 2.0], [9.0, 3.0]) == (
        "step time (step 2; step 1 warms up): swap off 2.00s, swap on 3.00s (1.50x)"
    )
    assert step_time_line([4.0], [5.0]) == (
        "step time (one step, warm-up included): swap off 4.00s, swap on 5.00s (1.25x)"
    )


def read_until_closed(controller: int) -> str:
    """Everything the terminal's other end wrote: one read returns one write's worth."""
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the terminal side is closed and drained
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    return b"".join(chunks).decode()


def test_progress_redraws_one_line_only_on_a_terminal(tmp_path: Path) -> None:
    controller, terminal_fd = os.openpty()
    with os.fdopen(terminal_fd, "w") as terminal:
        bar = Progress(terminal, 2)
        assert bar.terminal
        bar.show(0, "running...")
        bar.show(1, "loss 4.0")
        bar.show(2, "loss 3.0")
        bar.close()
    written = read_until_closed(controller)
    assert written.replace("\r\n", "\n") == (
        "\r  [                    ] step 0/2 running..."
        "\r  [##########          ] step 1/2 loss 4.0"
        "\r  [####################] step 2/2 loss 3.0\n"
    )
    with (tmp_path / "demo.log").open("w") as log:
        lines = Progress(log, 2, label="fsdp step")
        assert not lines.terminal
        lines.show(0, "running...")
        lines.show(1, "loss 4.0")
        lines.close()
    assert (tmp_path / "demo.log").read_text() == (
        "  fsdp step 0/2 running...\n  fsdp step 1/2 loss 4.0\n"
    )


def test_moe_demo_trains_pp4_ep2_in_one_process(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ppswap demo --moe`` (torch by default): eight ranks, losses bit-identical with
    swap, each rank's peak of saved bytes lower with it."""
    pytest.importorskip("torch")
    from ppswap.cli_demo import DEMO_MOE_DP
    from ppswap.demo.moe_demo import MOE_DP

    assert DEMO_MOE_DP == MOE_DP
    argv = ["demo", "--moe", "--pp", "4", "--micro", "4", "--batch", "8", "--steps", "2"]
    assert main([*argv, "--no-plot", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "pp=4 vpp=1 dp=2 ep=2 micro=4 (8 ranks), torch char LM with a 4-expert" in err
    assert "bit-identical: yes" in out
    rows = re.findall(r"^ +(\d) +\(\d,\d\) \|.*\| +([\d,]+) \| +([\d,]+) \| +[\d.]+%$", out, re.M)
    assert [int(rank) for rank, _, _ in rows] == list(range(8))
    for _, off, on in rows:
        assert int(on.replace(",", "")) < int(off.replace(",", ""))
    assert (tmp_path / "trace_moe_swap.json").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--backend", "mindspore"], "backend must be 'torch' with --moe (the MoE demo runs"),
        (["--fsdp"], "moe takes neither --fsdp nor another transport"),
        (["--transport", "mpi"], "moe takes neither --fsdp nor another transport"),
        (["--batch", "8", "--micro", "8"], "batch must be divisible by micro * dp = 16 with --moe"),
    ],
)
def test_cli_refuses_bad_moe_demo_options(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["demo", "--moe", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
