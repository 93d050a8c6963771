"""The package layers of ppswap: no two parts import each other, and the lower layers
never reach up (docs/architecture.md draws the same picture).

A *part* is a subpackage (``ppswap/actors``, ``ppswap/swap`` ...) or a module at the top
of the package (``ppswap/stage.py`` ...). Every ``import`` / ``from ... import`` of a
ppswap module anywhere in a part's files (inside functions too) is an edge.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "ppswap"

# Lower layers first; a part may import only parts listed before it (and itself).
LAYERS = [
    {"errors", "scheduler"},
    {"core", "backends"},
    {"logs", "swap", "stage"},
    {"stage_run"},
    {"results", "fsdp"},
    {"moe"},
    {"options", "events", "metrics"},
    {"transports"},
    {"planning"},
    {"actors"},
    {"pipeline"},
    {"cli_args", "cli_budget", "cli_schedule"},
    {"cli_demo", "cli_plan", "cli_plot"},
    {"__init__", "demo", "cli", "__main__", "serve"},
]


def _part_of(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "ppswap":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        source = relative.parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                target = _part_of(name)
                if target is not None and target != source:
                    edges[source].add(target)
    return edges


def test_no_two_parts_import_each_other() -> None:
    edges = _edges()
    both_ways = sorted(
        (a, b)
        for a, b in itertools.combinations(sorted(edges), 2)
        if b in edges[a] and a in edges[b]
    )
    assert both_ways == []


def test_every_part_imports_only_lower_layers() -> None:
    layer_of = {part: index for index, layer in enumerate(LAYERS) for part in layer}
    edges = _edges()
    unknown = sorted(set(edges) - set(layer_of))
    assert unknown == [], f"place these parts in LAYERS: {unknown}"
    upward = sorted(
        f"{source} -> {target}"
        for source, targets in edges.items()
        for target in targets
        if layer_of.get(target, 99) >= layer_of[source] and target not in LAYERS[layer_of[source]]
    )
    assert upward == []


def test_the_scan_finds_edges() -> None:
    edges = _edges()
    assert "scheduler" in edges["actors"] and "core" in edges["fsdp"]
    assert "actors" not in edges["fsdp"] and "actors" not in edges["swap"]
