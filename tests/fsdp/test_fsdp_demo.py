"""``run_fsdp_demo``: swap on/off bit-identical, parameter and activation savings reported,
for the LM of either backend."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from ppswap.demo.fsdp_demo import format_fsdp_report, run_fsdp_demo
from ppswap.demo.run import DEMO_LM_SIZES, DemoOptions

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("backend", ["mindspore", "torch"])
def test_fsdp_demo_reports_parameter_and_activation_savings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], backend: str
) -> None:
    pytest.importorskip(backend)
    opts = DemoOptions(
        schedule="gpipe", pp=2, micro=1, batch=2, steps=2, out_dir=tmp_path, backend=backend
    )
    report = run_fsdp_demo(opts, dp=2)
    assert report.losses_no_swap == report.losses_swap
    assert len(report.step_times_no_swap) == len(report.step_times_swap) == 2
    progress = capsys.readouterr().err
    for step in (1, 2):  # the two trainings take their steps in turn: both times each step
        both = rf"fsdp step {step}/2 loss [0-9.]+ \(swap off [0-9.]+s, swap on [0-9.]+s\)"
        assert re.search(both, progress), progress
    assert f"{backend} char LM" in progress
    assert len(report.last_swap.ranks) == 4
    # The first stage's positional table is (1, seq, dim): one row, padded to dp rows, so
    # each replica's shard holds all of it, half of it over an even split.
    table_half = DEMO_LM_SIZES["seq"] * DEMO_LM_SIZES["dim"] * 4 // 2
    for stats in report.last_swap.ranks:
        assert 0 < stats.resident_param_bytes < stats.unsharded_param_bytes
        assert stats.resident_param_bytes <= stats.unsharded_param_bytes // 2 + table_half
    text = format_fsdp_report(report)
    assert "bit-identical: yes" in text
    assert "saved by FSDP, dp=2" in text and "saved by swap" in text
    assert "step time (step 2; step 1 warms up): swap off" in text
    assert (tmp_path / "trace_fsdp_swap.json").exists()


def test_fsdp_demo_refuses_a_batch_that_does_not_split_over_dp(tmp_path: Path) -> None:
    opts = DemoOptions(pp=2, micro=1, batch=3, steps=1, out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"batch must be divisible by micro \* dp = 2"):
        run_fsdp_demo(opts, dp=2)
