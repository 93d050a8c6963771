"""`ppswap plan`: JSON and text output, flags, and errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from ppswap.cli import CLI_COPY_LEAVES, cli_cost_model, main, plan_payload
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.lowering import build_all_orders
from ppswap.scheduler.schedules import compute_order
from ppswap.scheduler.steps import MetaStep

OFFLOAD_COLOR = "#d9534f"  # ppswap.scheduler.plot's offload windows


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def test_json_plan_is_the_documented_document(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run(
        capsys,
        "plan", "--schedule", "interleaved_1f1b", "--pp", "2", "--vpp", "2", "--micro", "4",
        "--split-dw", "--overlap-b-f", "--p2p", "batch", "--fsdp", "--format", "json",
    )  # fmt: skip
    assert status == 0 and err == ""
    document = json.loads(out)
    assert list(document) == ["schedule", "pp", "vpp", "micro", "ranks"]
    assert (document["schedule"], document["pp"], document["vpp"], document["micro"]) == (
        "interleaved_1f1b", 2, 2, 4,
    )  # fmt: skip
    config = ScheduleConfig(
        schedule="interleaved_1f1b", pp=2, vpp=2, micro=4, split_dw=True, overlap_b_f=True,
        p2p="batch", fsdp=True,
    )  # fmt: skip
    orders = build_all_orders(config)
    assert [entry["rank"] for entry in document["ranks"]] == [0, 1]
    for entry, order in zip(document["ranks"], orders, strict=True):
        assert tuple(MetaStep.from_dict(step) for step in entry["steps"]) == order
    assert document == plan_payload(config)


def test_compute_only_prints_compute_slots(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "plan", "--schedule", "1f1b", "--pp", "3", "--micro", "4", "--compute-only",
        "--format", "json",
    )  # fmt: skip
    assert status == 0
    config = ScheduleConfig(schedule="1f1b", pp=3, micro=4)
    steps = json.loads(out)["ranks"][1]["steps"]
    assert tuple(MetaStep.from_dict(s) for s in steps) == compute_order(config, 1)


def test_text_plan_is_a_grid(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "plan", "--schedule", "gpipe", "--pp", "2", "--micro", "2")
    assert status == 0
    lines = out.splitlines()
    assert lines[0].startswith("schedule=gpipe pp=2 vpp=1 micro=2 p2p=plain options=none")
    assert lines[1].startswith("step")
    assert lines[2].split() == [
        "rank", "0", "|", "F0.0", "SF0.0", "F1.0", "SF1.0", "RB0.0", "B0.0", "RB1.0", "B1.0",
    ]  # fmt: skip
    assert lines[3].startswith("rank 1 |")


def test_swap_flags_reach_the_config(capsys: pytest.CaptureFixture[str]) -> None:
    base = ("plan", "--schedule", "gpipe", "--pp", "1", "--micro", "6", "--format", "json")
    _, without, _ = run(capsys, *base)
    _, with_swap, _ = run(capsys, *base, "--swap")
    _, strict_gap, _ = run(capsys, *base, "--swap", "--min-swap-gap", "100")

    def kinds(document: str) -> set[str]:
        return {step["kind"] for step in json.loads(document)["ranks"][0]["steps"]}

    assert not any(kind.startswith("SWAP_") for kind in kinds(without))
    assert "SWAP_LAUNCH_OFFLOAD" in kinds(with_swap)
    assert not any(kind.startswith("SWAP_") for kind in kinds(strict_gap))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--pp", "0", "--micro", "4"), "pp must be an int >= 1, got 0"),
        (("--pp", "2", "--micro", "0"), "micro must be an int >= 1, got 0"),
        (("--pp", "2", "--micro", "4", "--vpp", "2"), "vpp must be 1 for schedule '1f1b'"),
        (("--pp", "2", "--micro", "4", "--min-swap-gap", "1"), "min_swap_gap must be an int >= 2"),
    ],
)
def test_bad_config_exits_2_with_the_message(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    status, out, err = run(capsys, "plan", "--schedule", "1f1b", *argv)
    assert status == 2 and out == ""
    assert err.startswith("ppswap: error: ") and message in err


def test_interleaved_and_overlap_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    status, _, err = run(
        capsys, "plan", "--schedule", "interleaved_1f1b", "--pp", "4", "--vpp", "2", "--micro", "6"
    )
    assert status == 2 and "micro must be a multiple of pp=4" in err
    status, _, err = run(
        capsys, "plan", "--schedule", "gpipe", "--pp", "2", "--micro", "4", "--overlap-b-f"
    )
    assert status == 2 and "overlap_b_f" in err


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["plan", "--schedule", "zigzag", "--pp", "2", "--micro", "2"])
    assert caught.value.code == 2
    assert "invalid choice: 'zigzag'" in capsys.readouterr().err
    assert main([]) == 2
    assert "plan" in capsys.readouterr().err


LARGE = (
    "plan", "--schedule", "interleaved_1f1b", "--pp", "4", "--vpp", "2", "--micro", "16",
    "--swap", "--fsdp",
)  # fmt: skip


def _row_cells(text: str, rank: int) -> list[str]:
    """Every cell of ``rank``'s rows, over all the blocks of the folded grid."""
    cells: list[str] = []
    for line in text.splitlines():
        label, _, row = line.partition("|")
        if label.strip() == f"rank {rank}":
            cells += row.split()
    return cells


def test_text_plan_fits_the_width_and_keeps_every_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, err = run(capsys, *LARGE)
    assert status == 0 and err == ""
    assert max(len(line) for line in out.splitlines()) <= 100
    config = ScheduleConfig(
        schedule="interleaved_1f1b", pp=4, vpp=2, micro=16, swap=True, fsdp=True
    )
    for rank, order in enumerate(build_all_orders(config)):
        assert _row_cells(out, rank) == [step.short() for step in order]
    assert "steps 0-" in out  # folded into labelled blocks
    _, narrow, _ = run(capsys, *LARGE, "--width", "60")
    assert max(len(line) for line in narrow.splitlines()) <= 60
    _, wide, _ = run(capsys, *LARGE, "--width", "0")
    assert len(re.findall(r"^rank \d \|", wide, re.MULTILINE)) == 4  # one line a rank


def test_text_plan_has_a_legend_of_every_code(capsys: pytest.CaptureFixture[str]) -> None:
    _, out, _ = run(capsys, *LARGE)
    grid, legend = out.split("\nlegend: ", 1)
    codes = set(re.findall(r"\b([A-Z]+)\d*\.", grid))  # F3.0, LO3.0, UN.s2, ...
    assert {"F", "B", "SF", "RF", "SB", "RB", "LO", "WO", "LL", "WL", "UN", "RE"} <= codes
    explained = {line.split()[0] for line in legend.splitlines() if line.startswith("  ")}
    assert codes <= explained
    assert "SWAP_WAIT_LOAD" in legend and "micro-batch" in legend


@pytest.mark.parametrize("width", ["-1", "49"])
def test_bad_width_exits_2(capsys: pytest.CaptureFixture[str], width: str) -> None:
    status, out, err = run(capsys, "plan", "--schedule", "gpipe", "--pp", "2", "--micro", "2",
                           "--width", width)  # fmt: skip
    assert status == 2 and out == ""
    assert f"width must be 0 (one line per rank) or an int >= 50, got {width}" in err


def test_json_plan_is_unchanged_by_the_text_options(capsys: pytest.CaptureFixture[str]) -> None:
    _, document, _ = run(capsys, *LARGE, "--format", "json")
    _, narrow, _ = run(capsys, *LARGE, "--format", "json", "--width", "60")
    config = ScheduleConfig(
        schedule="interleaved_1f1b", pp=4, vpp=2, micro=16, swap=True, fsdp=True
    )
    assert json.loads(document) == json.loads(narrow) == plan_payload(config)


def test_interleaved_vpp_defaults_to_2(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys, "plan", "--schedule", "interleaved_1f1b", "--pp", "2", "--micro", "4",
        "--format", "json",
    )  # fmt: skip
    assert status == 0 and json.loads(out)["vpp"] == 2
    status, _, err = run(
        capsys, "plan", "--schedule", "interleaved_1f1b", "--pp", "2", "--micro", "4",
        "--vpp", "1",
    )  # fmt: skip
    assert status == 2 and "vpp must be >= 2 for interleaved_1f1b, got 1" in err


def test_swap_policy_peak_prints_its_orders_and_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """1F1B pp4 m16: the gap rule swaps 16 and 14 chunks of ranks 0 and 1, the peak policy
    8 and none, for the same peaks; the JSON carries the policy's orders and rows."""
    base = ("plan", "--schedule", "1f1b", "--pp", "4", "--micro", "16", "--swap")
    status, out, err = run(capsys, *base, "--swap-policy", "peak", "--format", "json")
    assert status == 0 and err == ""
    document = json.loads(out)
    config = ScheduleConfig(schedule="1f1b", pp=4, micro=16, swap=True)
    assert document == plan_payload(config, swap_policy="peak")
    assert document["swap_policy"] == "peak"
    rows = {
        policy: plan_payload(config, swap_policy=policy)["memory"] for policy in ("gap", "peak")
    }
    assert [r["eligible"] for r in rows["gap"]] == [16, 14, 0, 0]
    assert [r["eligible"] for r in rows["peak"]] == [8, 0, 0, 0]
    peaks = {p: [r["peak_chunks_swap"] for r in rows[p]] for p in rows}
    assert peaks["gap"] == peaks["peak"] == [3, 3, 2, 1]
    offloads = [
        sum(step["kind"] == "SWAP_LAUNCH_OFFLOAD" for step in rank["steps"])
        for rank in document["ranks"]
    ]
    assert offloads == [8, 0, 0, 0]
    status, text, _ = run(capsys, *base, "--swap-policy", "peak", "--width", "0")
    assert status == 0
    assert "min_swap_gap=4 swap_policy=peak" in text.splitlines()[0]
    assert "   1 |        0 |            3 |         3" in text.splitlines()


def test_swap_policy_cost_plans_with_the_cli_cost_model(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """GPipe pp4 m8: copies of one leaf, offloads and loads on their own streams, hide
    all 8 chunks of each rank within the 2% budget, copies of two leaves none; the JSON is
    the API's with that model."""
    base = ("plan", "--schedule", "gpipe", "--pp", "4", "--micro", "8", "--swap")
    config = ScheduleConfig(schedule="gpipe", pp=4, micro=8, swap=True)
    status, out, err = run(capsys, *base, "--swap-policy", "cost", "--format", "json")
    assert status == 0 and err == ""
    document = json.loads(out)
    assert document["swap_policy"] == "cost"
    assert document == plan_payload(
        config, swap_policy="cost", cost_model=cli_cost_model(CLI_COPY_LEAVES, 0.02)
    )
    assert [r["eligible"] for r in document["memory"]] == [8, 8, 8, 8]
    status, out, _ = run(
        capsys, *base, "--swap-policy", "cost", "--copy-leaves", "2", "--format", "json"
    )
    assert status == 0
    assert [r["eligible"] for r in json.loads(out)["memory"]] == [0, 0, 0, 0]
    status, text, _ = run(capsys, *base, "--swap-policy", "cost", "--width", "0")
    assert status == 0
    assert "swap_policy=cost copy_leaves=1 cost_budget=0.02" in text.splitlines()[0]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--copy-leaves", "2"), "copy_leaves is only used with swap_policy 'cost', got"),
        (("--swap-policy", "peak", "--cost-budget", "0.1"), "cost_budget is only used with"),
        (("--swap-policy", "cost", "--copy-leaves", "0"), "copy_leaves must be a finite"),
        (("--swap-policy", "cost", "--cost-budget", "2"), "cost_budget must be a number in"),
    ],
)
def test_cost_options_are_checked(
    capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], message: str
) -> None:
    base = ("plan", "--schedule", "gpipe", "--pp", "2", "--micro", "4", "--swap")
    status, out, err = run(capsys, *base, *flags)
    assert status == 2 and out == ""
    assert err.startswith(f"ppswap: error: {message}") and err.count("\n") == 1


def test_plot_draws_the_chunks_of_its_swap_policy(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """1F1B pp4 m16: the gap rule offloads 16 + 14 chunks, the peak policy 8; each offload
    window is one shape of the offload colour (the legend and the row marks add the same
    few to both drawings)."""
    pytest.importorskip("matplotlib")
    base = ("plot", "--schedule", "1f1b", "--pp", "4", "--micro", "16", "--swap")
    windows = {}
    for policy in ("gap", "peak"):
        path = tmp_path / f"{policy}.svg"
        status, out, _ = run(capsys, *base, "--swap-policy", policy, "-o", str(path))
        assert status == 0 and out == f"wrote {path}\n"
        windows[policy] = path.read_text().count(f"fill: {OFFLOAD_COLOR}")
    assert windows["gap"] - windows["peak"] == 30 - 8
