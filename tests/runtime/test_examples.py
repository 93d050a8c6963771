"""The examples run as scripts and really move activations; those that train with swap off
and on report bit-identical losses and a lower peak with swap. Each says its framework in
its header, and without that framework exits with one line saying how to install it."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "script",
    [
        pytest.param("module_swap.py", marks=pytest.mark.mindspore),
        pytest.param("tensor_swap.py", marks=pytest.mark.mindspore),
        "torch_pipeline.py",
    ],
)
def test_example_runs_and_offloads(script: str) -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    offloaded = [int(v) for v in re.findall(r"offloaded (\d+) B", done.stdout)]
    assert offloaded and all(v > 0 for v in offloaded)
    assert "bit-identical: NO" not in done.stdout
    peaks = re.findall(r"peak saved (\d+) B without swap, (\d+) B with swap", done.stdout)
    assert all(int(on) < int(off) for off, on in peaks), peaks
    if script == "torch_pipeline.py":
        assert "bit-identical: yes" in done.stdout
        assert len(peaks) == len(offloaded) == 4  # one line per rank


def _moe_example_output(launcher: list[str]) -> str:
    pytest.importorskip("torch")
    done = subprocess.run(
        [*launcher, str(ROOT / "examples" / "moe_pipeline.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_moe_example_trains_pp4_ep2_with_swap_in_one_process() -> None:
    out = _moe_example_output([sys.executable])
    losses = [float(v) for v in re.findall(r"step \d: loss ([0-9.]+)", out)]
    assert len(losses) == 3 and losses[2] < losses[0]
    ranks = re.findall(r"rank (\d): peak saved (\d+) B, offloaded (\d+) B", out)
    assert [int(r) for r, _, _ in ranks] == list(range(8))
    assert all(int(peak) > 0 for _, peak, _ in ranks)
    assert sum(int(moved) for _, _, moved in ranks) > 0


def test_the_moe_example_under_torchrun_gives_the_same_losses() -> None:
    """Eight processes over gloo train to the one-process run's losses (to print rounding)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed here")
    alone = _moe_example_output([sys.executable])
    spread = _moe_example_output([str(torchrun), "--standalone", "--nproc-per-node", "8"])
    assert re.findall(r"step \d: loss .*", spread) == re.findall(r"step \d: loss .*", alone)
    assert len(re.findall(r"rank \d: peak saved", spread)) == 8


EXAMPLE_FRAMEWORKS = {
    "module_swap.py": ("mindspore", "MindSpore"),
    "tensor_swap.py": ("mindspore", "MindSpore"),
    "async_service.py": ("mindspore", "MindSpore"),
    "torch_pipeline.py": ("torch", "torch"),
    "torchrun_pipeline.py": ("torch", "torch"),
    "moe_pipeline.py": ("torch", "torch"),
}


def test_every_example_says_its_framework() -> None:
    assert set(EXAMPLE_FRAMEWORKS) == {path.name for path in (ROOT / "examples").glob("*.py")}
    for script, (extra, name) in EXAMPLE_FRAMEWORKS.items():
        header = (ROOT / "examples" / script).read_text().split('"""')[1]
        assert f"Needs {name} (``pip install -e '.[{extra}]'``)" in header, script


@pytest.mark.parametrize("script", sorted(EXAMPLE_FRAMEWORKS))
def test_an_example_without_its_framework_is_one_line(script: str) -> None:
    """The framework made unimportable (as where it is not installed, such as the
    torch-only environment for the MindSpore examples): exit 1, one line, no traceback."""
    extra, name = EXAMPLE_FRAMEWORKS[script]
    path = ROOT / "examples" / script
    code = (
        "import runpy, sys\n"
        f"sys.modules[{extra!r}] = None  # importing it now fails\n"
        f"sys.argv = [{str(path)!r}]\n"
        f"runpy.run_path({str(path)!r}, run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith(
        f"examples/{script} runs on {name}, which is not installed: "
        f"pip install -e '.[{extra}]' in the ppswap checkout"
    )
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("mindspore") is not None, reason="MindSpore is installed here"
)
def test_a_mindspore_example_where_mindspore_is_not_installed() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "module_swap.py")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("examples/module_swap.py runs on MindSpore, which is not")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
