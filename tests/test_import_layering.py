"""The import graph of megaflow: no circles, and the leaf packages stay leaves.

Every ``import`` / ``from ... import`` in megaflow's sources counts, also those inside
functions (a function-level import hides a circle from Python but not from a reader),
except the ones under ``if TYPE_CHECKING:`` (annotations only, never executed). A
package's ``__init__`` re-exports count as edges of the package module.

Leaves: ``megaflow.protocol``, ``megaflow.algorithms`` and ``megaflow.config`` import no
other part of megaflow (``config`` may use ``algorithms``' pure names), so the RL math, the
batch type and the config tree can be read, tested and reused on their own.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "megaflow"
LEAVES = {"megaflow.protocol": set(), "megaflow.algorithms": set(), "megaflow.config": {"megaflow.algorithms"}}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(tree: ast.AST, package: str):
    """Absolute names imported by ``tree`` at run time (TYPE_CHECKING blocks skipped)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """megaflow module -> the megaflow modules it imports at run time."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = {resolve(t) for t in _imports(ast.parse(path.read_text()), package) if t.startswith("megaflow")}
        graph[name] = {t for t in targets if t and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan 1972)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_checker_finds_a_circle_and_skips_type_checking_imports():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import megaflow.x\n"
                     "def f():\n    from megaflow import y\n")
    assert set(_imports(tree, "megaflow")) == {"typing", "typing.TYPE_CHECKING", "megaflow", "megaflow.y"}


def test_megaflow_has_no_import_circles():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("leaf", sorted(LEAVES))
def test_leaf_packages_import_no_other_part_of_megaflow(leaf):
    allowed = LEAVES[leaf] | {leaf}
    bad = {module: sorted(t for t in targets if not any(t == a or t.startswith(a + ".") for a in allowed))
           for module, targets in import_graph().items() if module == leaf or module.startswith(leaf + ".")}
    assert {m: t for m, t in bad.items() if t} == {}
