"""`ppswap demo`'s options: every bad one is one error line and exit 2, before anything is
built; the help text gives every option's default."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from ppswap.cli import build_parser, main
from ppswap.cli_demo import DEMO_BACKENDS, DEMO_DEFAULTS, demo_backend, demo_config
from ppswap.demo.run import DEMO_MODELS, DemoOptions


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(list(argv))
    captured = capsys.readouterr()
    return status, captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--schedule", "interleaved_1f1b", "--vpp", "1"), "vpp must be >= 2 for interleaved_1f1b"),
        (("--schedule", "interleaved_1f1b", "--micro", "6", "--batch", "12"),
         "micro must be a multiple of pp=4 for interleaved_1f1b, got 6"),
        (("--schedule", "gpipe", "--vpp", "2"), "vpp must be 1 for schedule 'gpipe', got 2"),
        (("--micro", "3", "--batch", "16"), "batch must be divisible by micro=3, got batch=16"),
        (("--pp", "0",), "pp must be an int >= 1, got 0"),
        (("--micro", "0",), "micro must be an int >= 1, got 0"),
        (("--steps", "0",), "steps must be an int >= 1, got 0"),
        (("--batch", "-4",), "batch must be an int >= 1, got -4"),
        (("--fsdp", "--micro", "16", "--batch", "16"),
         "batch must be divisible by micro * dp = 32 with --fsdp"),
        (("--fsdp", "--transport", "mpi"), "transport must be 'inprocess' with --fsdp"),
        (("--backend", "jax"), "backend must be one of mindspore, torch, got 'jax'"),
        (("--backend", "Torch"), "backend must be one of mindspore, torch, got 'Torch'"),
        (("--transport", "torch", "--backend", "mindspore"),
         "backend must be 'torch' with --transport torch"),
        (("--transport", "torch", "--fsdp", "--micro", "4"),
         "transport must be 'inprocess' with --fsdp"),
    ],
)  # fmt: skip
def test_bad_demo_config_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: tuple[str, ...], message: str
) -> None:
    status, out, err = run(capsys, "demo", "--no-plot", "--out", str(tmp_path / "o"), *argv)
    assert status == 2 and out == ""
    assert err.startswith("ppswap: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()  # refused before anything was made


def test_out_that_cannot_be_a_folder_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x", encoding="utf-8")
    status, _, err = run(capsys, "demo", "--out", str(blocker / "out"))
    assert status == 2
    assert err.startswith(
        f"ppswap: error: out must be a folder that can be created, got '{blocker}"
    )


def test_bad_demo_config_from_the_console_has_no_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ppswap.cli", "demo", "--schedule", "interleaved_1f1b",
         "--pp", "4", "--micro", "6", "--batch", "12", "--out", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == (
        "ppswap: error: micro must be a multiple of pp=4 for interleaved_1f1b, got 6"
    )


def _demo_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["demo", *argv])


def test_the_demo_backend_defaults_to_torch_under_torchrun(tmp_path: Path) -> None:
    out = ("--out", str(tmp_path))
    assert demo_backend(_demo_args(*out)) == "mindspore"
    assert demo_backend(_demo_args("--transport", "torch", *out)) == "torch"
    assert demo_backend(_demo_args("--transport", "mpi", "--backend", "torch", *out)) == "torch"
    assert demo_config(_demo_args("--transport", "torch", *out)).pp == 4


def test_interleaved_demo_defaults_vpp_to_2(tmp_path: Path) -> None:
    config = demo_config(_demo_args("--schedule", "interleaved_1f1b", "--out", str(tmp_path)))
    assert (config.schedule, config.vpp, config.pp, config.micro) == ("interleaved_1f1b", 2, 4, 8)
    assert demo_config(_demo_args("--out", str(tmp_path))).vpp == 1
    explicit = _demo_args("--schedule", "interleaved_1f1b", "--vpp", "4", "--out", str(tmp_path))
    assert demo_config(explicit).vpp == 4


def test_cli_defaults_are_the_demo_options_defaults() -> None:
    defaults = DemoOptions()
    assert {
        "schedule": defaults.schedule,
        "pp": defaults.pp,
        "micro": defaults.micro,
        "batch": defaults.batch,
        "steps": defaults.steps,
        "out": str(defaults.out_dir),
        "transport": defaults.transport,
        "backend": defaults.backend,
    } == DEMO_DEFAULTS
    assert defaults.vpp == 1 and defaults.plot and not defaults.fsdp
    assert tuple(DEMO_BACKENDS) == tuple(DEMO_MODELS) == ("mindspore", "torch")


def test_demo_options_refuse_a_bad_backend(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backend must be one of mindspore, torch, got 'jax'"):
        DemoOptions(backend="jax", out_dir=tmp_path)


_NO_MINDSPORE = "import sys\nsys.modules['mindspore'] = None  # importing it now fails\n"


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )


def test_the_checks_need_no_tensor_framework(tmp_path: Path) -> None:
    loaded = _python(
        "import sys, ppswap.cli\nprint([m for m in ('mindspore', 'torch') if m in sys.modules])\n"
    )
    assert loaded.returncode == 0 and loaded.stdout.strip() == "[]", loaded.stderr
    refused = _python(
        _NO_MINDSPORE + "from ppswap.cli import main\n"
        f"sys.exit(main(['demo', '--micro', '4', '--batch', '6', '--out', {str(tmp_path)!r}]))\n"
    )
    assert refused.returncode == 2
    assert refused.stderr == "ppswap: error: batch must be divisible by micro=4, got batch=6\n"


def test_plan_and_plot_import_no_tensor_framework(tmp_path: Path) -> None:
    diagram = tmp_path / "gpipe.svg"
    done = _python(
        "import sys\nfrom ppswap.cli import main\n"
        "assert main(['plan', '--schedule', '1f1b', '--pp', '2', '--micro', '4', '--swap']) == 0\n"
        "assert main(['plan', '--schedule', 'gpipe', '--pp', '2', '--micro', '4', "
        "'--format', 'json']) == 0\n"
        f"assert main(['plot', '--schedule', 'gpipe', '--pp', '2', '--micro', '4', '--swap', "
        f"'-o', {str(diagram)!r}]) == 0\n"
        "print('loaded:', [m for m in ('mindspore', 'torch') if m in sys.modules])\n"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "loaded: []"
    assert diagram.exists()


def test_a_torch_demo_without_torch_is_one_line(tmp_path: Path) -> None:
    done = _python(
        "import sys\nsys.modules['torch'] = None  # importing it now fails\n"
        "from ppswap.cli import main\n"
        f"sys.exit(main(['demo', '--backend', 'torch', '--out', {str(tmp_path)!r}]))\n"
    )
    assert done.returncode == 2
    assert done.stderr == (
        "ppswap: error: ppswap demo needs torch: pip install -e '.[torch]' in the ppswap checkout\n"
    )


def test_a_demo_without_mindspore_is_one_line(tmp_path: Path) -> None:
    done = _python(
        _NO_MINDSPORE + "from ppswap.cli import main\n"
        f"sys.exit(main(['demo', '--out', {str(tmp_path)!r}]))\n"
    )
    assert done.returncode == 2
    assert (
        done.stderr
        == "ppswap: error: ppswap demo needs MindSpore: pip install -e '.[mindspore]' in the "
        "ppswap checkout\n"
    )


def test_demo_help_gives_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as caught:
        main(["demo", "--help"])
    assert caught.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help lines
    for expected in (
        "schedule family (default gpipe)",
        "pipeline ranks (default 4)",
        "default: 2 for interleaved_1f1b",
        "(default 8)",
        "(default 32)",
        "training steps per pass (default 3)",
        "(default out)",
        "skip the diagram (default: draw it)",
        "(default: off)",
        "(default inprocess)",
        "mindspore or torch (default mindspore; torch with --transport torch or --moe)",
        "torch: one process per rank over torch.distributed (gloo), under torchrun",
    ):
        assert expected in text


def test_every_demo_option_has_help_with_its_default() -> None:
    subparsers = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    demo = subparsers.choices["demo"]
    options = [action for action in demo._actions if action.option_strings != ["-h", "--help"]]
    assert len(options) == 12
    for action in options:
        assert action.help and "default" in action.help, action.option_strings
