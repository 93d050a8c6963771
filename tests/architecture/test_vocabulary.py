"""One step vocabulary: every category of ``StepKind`` is defined in
``ppswap/scheduler/steps.py`` and imported from there, never restated.

Read from the sources (ast), at module level (class bodies included, function bodies not):
a module other than ``steps.py`` may not build a set, frozenset, tuple or list literal of
two or more kinds, nor a mapping from kinds to kinds (``{StepKind.A: StepKind.B, ...}``):
``steps.py`` has it (``SEND_KINDS``, ``LAUNCH_OF_WAIT`` ...), or gets it. A kind is
written ``StepKind.X``, or as a name bound to a member: one of ``steps.py``'s member
constants (``from ppswap.scheduler.steps import FWD``) or a module's own alias.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from ppswap.scheduler.steps import StepKind

PACKAGE = Path(__file__).resolve().parents[2] / "ppswap"
VOCABULARY = PACKAGE / "scheduler" / "steps.py"


MEMBERS = frozenset(
    target.id
    for node in ast.walk(ast.parse(VOCABULARY.read_text()))
    if isinstance(node, ast.ClassDef) and node.name == "StepKind"
    for statement in node.body
    if isinstance(statement, ast.Assign)
    for target in statement.targets
    if isinstance(target, ast.Name) and target.id.isupper()
)
"""The names of StepKind's members, read from its class body."""


def _is_step_kind_attribute(node: ast.AST | None) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == "StepKind"
    )


def _member_names(tree: ast.Module) -> frozenset[str]:
    """The module-level names of ``tree`` bound to a member: imported member constants
    of ``steps.py`` and aliases (``_FWD = StepKind.FWD``)."""
    names = set()
    for statement in tree.body:
        if isinstance(statement, ast.ImportFrom) and statement.module == "ppswap.scheduler.steps":
            names.update(a.asname or a.name for a in statement.names if a.name in MEMBERS)
        elif isinstance(statement, ast.Assign) and _is_step_kind_attribute(statement.value):
            names.update(t.id for t in statement.targets if isinstance(t, ast.Name))
    return frozenset(names)


def _module_level(body: list[ast.stmt]) -> Iterator[ast.AST]:
    """Every node of ``body`` outside function bodies (class bodies are entered)."""
    for statement in body:
        if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from statement.decorator_list
            continue
        if isinstance(statement, ast.ClassDef):
            yield from statement.decorator_list
            yield from _module_level(statement.body)
            continue
        stack: list[ast.AST] = [statement]
        while stack:
            node = stack.pop()
            yield node
            if not isinstance(node, ast.Lambda):
                stack.extend(ast.iter_child_nodes(node))


def restatements(source: str, filename: str = "<source>") -> list[str]:
    """``line: text`` of every category of kinds ``source`` builds at module level."""
    tree = ast.parse(source, filename=filename)
    member_names = _member_names(tree)

    def is_member(node: ast.AST | None) -> bool:
        return _is_step_kind_attribute(node) or (
            isinstance(node, ast.Name) and node.id in member_names
        )

    def mentions_member(node: ast.AST | None) -> bool:
        return node is not None and any(is_member(inner) for inner in ast.walk(node))

    found = []
    for node in _module_level(tree.body):
        if isinstance(node, ast.Set | ast.Tuple | ast.List):
            bad = sum(is_member(element) for element in node.elts) >= 2
        elif isinstance(node, ast.Dict):
            pairs = [(k, v) for k, v in zip(node.keys, node.values, strict=True) if is_member(k)]
            bad = len(pairs) >= 2 and all(mentions_member(value) for _, value in pairs)
        else:
            bad = False
        if bad:
            found.append(f"{getattr(node, 'lineno', '?')}: {ast.unparse(node)[:100]}")
    return found


def test_only_steps_py_defines_step_kind_categories() -> None:
    offenders = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != VOCABULARY
        for line in restatements(path.read_text(), str(path))
    ]
    assert offenders == [], (
        "define StepKind categories once, in ppswap/scheduler/steps.py, and import them: "
        + "; ".join(offenders)
    )


def test_the_check_sees_each_form_of_restatement() -> None:
    restated = (
        "from ppswap.scheduler.steps import BWD, FWD, SEND_F as _SEND_F, StepKind\n"
        "_LAUNCHES = frozenset({StepKind.SWAP_LAUNCH_OFFLOAD, StepKind.SWAP_LAUNCH_LOAD})\n"
        "_PAIR = (StepKind.BWD, StepKind.BWD_INPUT)\n"
        "_WAIT_OF = {StepKind.SWAP_WAIT_LOAD: (StepKind.SWAP_LAUNCH_LOAD, 'load'),\n"
        "            StepKind.SWAP_WAIT_OFFLOAD: (StepKind.SWAP_LAUNCH_OFFLOAD, 'offload')}\n"
        "class Actor:\n"
        "    _POSTS = {StepKind.SEND_F, StepKind.RECV_F}\n"
        "_LEAVES = frozenset({FWD, BWD})\n"
        "_RECV = StepKind.RECV_F\n"
        "_P2P = [_SEND_F, _RECV]\n"
    )
    lines = [line.split(":")[0] for line in restatements(restated)]
    assert lines == ["2", "3", "4", "7", "8", "10"]
    allowed = (
        "from ppswap.scheduler.steps import FWD, COMPUTE_KINDS, SEND_KINDS\n"
        "_LABELS = {StepKind.FWD: 'F', StepKind.BWD: 'B'}\n"
        "_ONE = frozenset({FWD})\n"
        "_FROM_STEPS = (COMPUTE_KINDS, SEND_KINDS)\n"
        "_FWD = StepKind.FWD\n"
        "def f(kind):\n"
        "    return kind in (StepKind.BWD, StepKind.BWD_INPUT)\n"
    )
    assert restatements(allowed) == []


def test_the_members_are_read_from_steps_py() -> None:
    assert {kind.name for kind in StepKind} == MEMBERS
