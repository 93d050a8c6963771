"""The README's "Using it" program runs as written, trains (the loss goes down) and swaps
(the measured peaks stay those of a run with swap: one line per step, every rank)."""

from __future__ import annotations

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ppswap import RunOptions
from ppswap.cli import main

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def readme_program(section: str = "## Using it") -> str:
    """The first ```python block after ``section`` in README.md."""
    text = (ROOT / "README.md").read_text()
    start = text.index(section)
    match = re.search(r"```python\n(.*?)```", text[start:], re.DOTALL)
    assert match is not None, f"no python block after {section!r}"
    return match.group(1)


@pytest.mark.mindspore
@pytest.mark.timeout(300)
def test_the_using_it_program_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "using_it.py"
    script.write_text(readme_program())
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    steps = re.findall(
        r"step (\d): loss ([0-9.]+), peak saved bytes per rank \[([0-9, ]+)\]", done.stdout
    )
    assert [int(s) for s, _, _ in steps] == [0, 1, 2], done.stdout
    losses = [float(loss) for _, loss, _ in steps]
    assert losses[-1] < losses[0]
    assert all(len(peaks.split(",")) == 2 and "0" not in peaks.split(", ") for _, _, peaks in steps)


def test_the_readme_names_no_file_outside_the_repository() -> None:
    text = (ROOT / "README.md").read_text()
    assert "../" not in text  # and no outside document by name: tests/architecture
    for path in re.findall(r"`((?:docs|examples|benchmarks|ppswap)/[\w./-]+)`", text):
        assert (ROOT / path).exists(), path


def test_the_readme_installs_from_a_checkout() -> None:
    # ppswap is not on a package index: every install is from the checkout or its git URL
    text = (ROOT / "README.md").read_text()
    installs = re.findall(r"pip install [^`\n]*", text)
    assert any("-e '.[torch]'" in line for line in installs), installs
    assert any("-e '.[mindspore]'" in line for line in installs), installs
    for line in installs:
        assert "-e '." in line or "@ git+" in line, line


def test_the_readme_lists_as_options_only_run_options_fields() -> None:
    # each bullet of the Options list opens with the fields it is about; trace is not one
    text = (ROOT / "README.md").read_text()
    start = text.index("Options (keywords of `run_schedule`")
    options = text[start : text.index("\n\n", text.index("\n- ", start))]
    fields = {field.name for field in dataclasses.fields(RunOptions)}
    named = []
    for bullet in options.split("\n- ")[1:]:
        opening = bullet.split(":", 1)[0].split(" (", 1)[0]
        named += re.findall(r"`([a-z0-9_]+)(?:=[^`]*)?`", opening)
    assert len(named) >= 14, named
    assert set(named) <= fields, set(named) - fields
    assert "trace" not in fields  # an argument of run_schedule and .run() only
    assert 'run_schedule(..., trace="run.json")' in text


def test_the_readme_plan_and_plot_commands_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every ``.venv/bin/ppswap plan`` / ``plot`` line of the README, as written (a
    diagram's file goes to a temporary folder)."""
    text = (ROOT / "README.md").read_text()
    commands = re.findall(r"^    \.venv/bin/ppswap (plan|plot) (.*?)(?:\s+#.*)?$", text, re.M)
    assert {name for name, _ in commands} == {"plan", "plot"}
    for name, rest in commands:
        argv = [name, *shlex.split(rest)]
        if name == "plot":
            pytest.importorskip("matplotlib")
            argv[argv.index("-o") + 1] = str(tmp_path / argv[argv.index("-o") + 1])
        assert main(argv) == 0, argv
        assert capsys.readouterr().err == ""
