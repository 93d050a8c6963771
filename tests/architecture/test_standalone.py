"""The repository stands alone: no file in it points to documents outside it (the design
notes the project started from live beside the repository, not in it)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Spelled in pieces, so that this file does not name them itself.
OUTSIDE = ("DESIGN" + ".md", "../" + "shared", "seeds" + "/")
SOURCES = ("ppswap", "docs", "tests", "benchmarks", "examples", ".ci")
SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ""}


def _files() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "Makefile", ROOT / "pyproject.toml"]
    for top in SOURCES:
        found += [
            p
            for p in (ROOT / top).rglob("*")
            if p.is_file() and p.suffix in SUFFIXES and "__pycache__" not in p.parts
        ]
    return found


def test_no_file_points_outside_the_repository() -> None:
    files = _files()
    assert len(files) > 100  # the walk found the package, its docs and tests
    offending = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if any(name in line for name in OUTSIDE)
    ]
    assert offending == []
