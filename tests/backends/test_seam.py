"""The backend seam: the runtime reaches a tensor framework only through ppswap.backends."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mindspore import nn

from ppswap.backends import backend_for, backend_named, framework_of

PACKAGE = Path(__file__).resolve().parents[2] / "ppswap"
FRAMEWORKS = ("mindspore", "torch")
# Where a framework may be imported: the backends, and the demo models (user code).
ALLOWED = ("backends", "demo")


def _framework_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found += [
            f"{name} (line {node.lineno})" for name in names if name.split(".")[0] in FRAMEWORKS
        ]
    return found


def test_no_framework_import_outside_the_backends() -> None:
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in ALLOWED:
            continue
        imports = _framework_imports(path)
        if imports:
            offenders[str(relative)] = imports
    assert offenders == {}


def test_the_scan_sees_a_framework_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import numpy\nfrom mindspore import Tensor\nimport torch.nn as nn\n")
    assert _framework_imports(probe) == ["mindspore (line 2)", "torch.nn (line 3)"]


@pytest.mark.parametrize("module", ["ppswap", "ppswap.scheduler", "ppswap.swap", "ppswap.backends"])
def test_importing_loads_no_framework(module: str) -> None:
    code = (
        f"import sys, {module}\n"
        f"loaded = [m for m in {FRAMEWORKS!r} if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


class _Foreign:
    def __call__(self, x: object) -> object:
        return x


def test_an_object_of_no_framework_is_refused_by_type() -> None:
    assert framework_of(_Foreign()) is None and framework_of(np.ones(3)) is None
    with pytest.raises(
        TypeError,
        match=r"module must be a mindspore\.nn\.Cell or a torch\.nn\.Module, got .*_Foreign",
    ):
        backend_for(_Foreign())
    with pytest.raises(ValueError, match="backend must be one of mindspore, torch, got 'jax'"):
        backend_named("jax")


def test_the_backend_follows_the_class_and_its_bases() -> None:
    class MyCell(nn.Cell):  # a user's cell: its own module path, MindSpore's base
        def construct(self, x):
            return x

    backend = backend_for(MyCell())
    assert backend.name == "mindspore" and backend is backend_named("mindspore")
    assert framework_of(nn.Dense(2, 2).weight) == "mindspore"
