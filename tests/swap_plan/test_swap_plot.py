"""The schedule diagram: files, labels, window packing, and matplotlib staying optional."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from ppswap import cli, cli_plot
from ppswap.scheduler.config import ScheduleConfig
from ppswap.scheduler.plot import cell_label, pack_windows, plot_schedule, schedule_figure
from ppswap.scheduler.simulate import CopyWindow
from ppswap.scheduler.steps import MetaStep, StepKind

K = StepKind
SMALL = ScheduleConfig(schedule="1f1b", pp=2, micro=6, overlap_b_f=True, split_dw=True)


def test_png_is_written(tmp_path: Path) -> None:
    target = plot_schedule(SMALL, tmp_path / "sub" / "plan.png")
    assert target == tmp_path / "sub" / "plan.png"
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert target.stat().st_size > 10_000


def test_svg_is_written(tmp_path: Path) -> None:
    target = plot_schedule(
        ScheduleConfig(schedule="interleaved_1f1b", pp=2, vpp=2, micro=4, fsdp=True),
        str(tmp_path / "plan.SVG"),
    )
    head = target.read_text(encoding="utf-8")[:400]
    assert "<svg" in head or "<?xml" in head


@pytest.mark.parametrize("name", ["plan.pdf", "plan", "plan.png.txt"])
def test_other_suffix_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match=r"path must end in \.png or \.svg"):
        plot_schedule(SMALL, tmp_path / name)
    assert not (tmp_path / name).exists()


def test_config_type_checked(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="config must be a ScheduleConfig"):
        plot_schedule({"schedule": "gpipe"}, tmp_path / "x.png")  # type: ignore[arg-type]


def test_cell_labels() -> None:
    eligible = frozenset({(1, 3)})
    assert cell_label(MetaStep(K.FWD, 1, 3), eligible) == "C·F"
    assert cell_label(MetaStep(K.BWD, 1, 3), eligible) == "W·B"
    assert cell_label(MetaStep(K.BWD_INPUT, 1, 3), eligible) == "W·dx"
    assert cell_label(MetaStep(K.BWD_WEIGHT, 1, 3), eligible) == "dw"
    assert cell_label(MetaStep(K.FWD, 1, 4), eligible) == "F"
    assert cell_label(MetaStep(K.BWD, 1, 4), eligible) == "B"
    assert cell_label(MetaStep(K.BWD_INPUT, 1, 4), eligible) == "dx"
    with pytest.raises(ValueError, match="compute leaf"):
        cell_label(MetaStep(K.FSDP_UNSHARD, 1, -1), eligible)


def test_pack_windows_stacks_overlaps_only() -> None:
    windows = [
        CopyWindow("load", 0, 0, 0, 3),
        CopyWindow("load", 0, 1, 1, 2),  # overlaps the first
        CopyWindow("load", 0, 2, 2, 4),  # starts when the second ends
        CopyWindow("load", 0, 3, 3, 3),  # a tick at 3: the first track is free again
        CopyWindow("load", 0, 4, 3, 5),  # the tick still holds track 0
    ]
    assert pack_windows(windows) == (0, 1, 1, 0, 2)


def test_scheduler_package_does_not_import_matplotlib() -> None:
    code = (
        "import sys\n"
        "import ppswap.scheduler, ppswap.scheduler.simulate, ppswap.scheduler.lowering\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'\n"
        "assert 'ppswap.scheduler.plot' not in sys.modules, 'plot imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("module", ["swap_plan", "simulate"])
def test_pure_modules_import_no_runtime_or_plotting(module: str) -> None:
    source = Path(__file__).parents[2] / "ppswap" / "scheduler" / f"{module}.py"
    tree = ast.parse(source.read_text(encoding="utf-8"))
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert imported.isdisjoint({"mindspore", "anyio", "matplotlib", "numpy"})


def _texts(config: ScheduleConfig) -> list[str]:
    """Every text drawn on the schedule and memory panels, legends and title included."""
    figure = schedule_figure(config)
    texts: list[str] = []
    for ax in figure.axes:
        texts += [text.get_text() for text in ax.texts]
        texts.append(ax.get_title())
        legend = ax.get_legend()
        if legend is not None:
            texts += [text.get_text() for text in legend.get_texts()]
    return texts


def test_without_swap_nothing_of_swap_is_drawn() -> None:
    config = ScheduleConfig(schedule="1f1b", pp=2, micro=6)
    texts = _texts(config)
    assert not {"offload", "load", "swap"} & set(texts)
    assert not any("·" in text or "window" in text for text in texts)  # no C·F, W·B
    assert any(text.endswith("no swap") for text in texts)  # title and memory legend


def test_with_swap_windows_and_marks_are_drawn() -> None:
    texts = _texts(ScheduleConfig(schedule="1f1b", pp=2, micro=6, swap=True))
    assert {"offload", "load", "swap", "no swap"} <= set(texts)
    assert any(text.startswith("C·F") for text in texts)
    assert any("offload window" in text for text in texts)


@pytest.mark.parametrize(("flags", "swap"), [((), False), (("--swap",), True)])
def test_cli_plot_swap_flag_reaches_the_diagram(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: tuple[str, ...], swap: bool
) -> None:
    drawn: list[ScheduleConfig] = []

    def fake_plot(config: ScheduleConfig, path: str, **policy: object) -> Path:
        drawn.append(config)
        return Path(path)

    monkeypatch.setattr(cli_plot, "load_plotter", lambda: fake_plot)
    argv = [
        "plot",
        "--schedule",
        "gpipe",
        "--pp",
        "2",
        "--micro",
        "4",
        "-o",
        str(tmp_path / "p.png"),
    ]
    assert cli.main([*argv, *flags]) == 0
    assert [config.swap for config in drawn] == [swap]
