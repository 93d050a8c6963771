"""The design RFC this project implements is cited once, by title, in
docs/architecture.md; every other file says in its own words what it takes from it
(a section number of a document outside the repository tells a reader nothing)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("ppswap", "docs", "tests", "benchmarks", "examples")
SUFFIXES = {".py", ".md", ".sh", ".txt", ".toml"}
CITATION = re.compile(r"\bRFC\b")


def test_the_design_rfc_is_cited_once_by_title() -> None:
    files = [ROOT / "README.md"] + [
        path
        for top in SOURCES
        for path in (ROOT / top).rglob("*")
        if path.is_file() and path.suffix in SUFFIXES and "__pycache__" not in path.parts
    ]
    citing = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in files
        if path != Path(__file__)
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if CITATION.search(line)
    ]
    assert len(citing) == 1 and citing[0].startswith("docs/architecture.md:"), citing
    architecture = (ROOT / "docs" / "architecture.md").read_text()
    assert "Pipeline scenario support for\nactivation swap, HyperParallel issue #174" in (
        architecture
    )
