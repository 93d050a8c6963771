"""docs/memory-model.md shows exactly what its generating command prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).parents[2]


def load_script() -> ModuleType:
    path = ROOT / "benchmarks" / "memory_model_table.py"
    spec = importlib.util.spec_from_file_location("memory_model_table", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_doc_tables_match_the_command() -> None:
    script = load_script()
    doc = (ROOT / "docs" / "memory-model.md").read_text(encoding="utf-8")
    assert "benchmarks/memory_model_table.py" in doc
    assert script.summary_table(script.NAMED_CONFIGS) in doc
    assert script.per_rank_table(script.NAMED_CONFIGS) in doc


def test_committed_diagrams_exist() -> None:
    script = load_script()
    doc = (ROOT / "docs" / "memory-model.md").read_text(encoding="utf-8")
    for name in script.DIAGRAMS:
        path = ROOT / "docs" / "diagrams" / name
        assert path.read_bytes()[:4] == b"\x89PNG"
        assert f"diagrams/{name}" in doc
