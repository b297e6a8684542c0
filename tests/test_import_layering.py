"""The import graph of megaflow: no circles, and each package imports only the layers below it.

Every ``import`` / ``from ... import`` in megaflow's sources counts: those inside functions
(a function-level import hides a circle from Python but not from a reader) and those under
``if TYPE_CHECKING:`` (an annotation is a dependency a reader follows, and a circle through
one is still a circle). A package's ``__init__`` re-exports count as edges of the package
module.

Contracts (package -> the parts of megaflow it may import besides itself):

* ``megaflow.protocol`` and ``megaflow.algorithms``: nothing (the batch type and the RL math
  stand alone);
* ``megaflow.config`` (the knobs): only ``algorithms``' pure names;
* ``megaflow.topology`` (what a config implies): only ``config`` (and ``algorithms``);
* ``megaflow.dryrun`` (planner, memory model, report): only ``topology`` and ``config``.

So ``config <- topology <- dryrun`` runs one way, and ``hybrid_engine``, ``workers`` and
``trainer`` sit above ``topology`` (nothing below imports them).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "megaflow"
LAYERS = {
    "megaflow.protocol": set(),
    "megaflow.algorithms": set(),
    "megaflow.config": {"megaflow.algorithms"},
    "megaflow.topology": {"megaflow.config", "megaflow.algorithms"},
    "megaflow.dryrun": {"megaflow.topology", "megaflow.config"},
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(tree: ast.AST, package: str):
    """Absolute names imported anywhere in ``tree`` (function bodies and TYPE_CHECKING blocks included)."""
    stack = [tree]
    while stack:
        node = stack.pop()
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
    """megaflow module -> the megaflow modules it imports (at run time or for annotations)."""
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


def test_the_checker_finds_a_circle_and_counts_type_checking_imports():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import megaflow.x\n"
                     "else:\n    import megaflow.z\n"
                     "def f():\n    from megaflow import y\n")
    assert set(_imports(tree, "megaflow")) == {"typing", "typing.TYPE_CHECKING", "megaflow.x", "megaflow.z",
                                               "megaflow", "megaflow.y"}


def test_a_circle_through_a_type_checking_import_is_found():
    """The circle the old config package had: schema imports layout at run time, layout
    imports schema back only for its annotations."""
    schema = ast.parse("from megaflow.config.layout import pack_pools\n")
    layout = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                       "    from megaflow.config.schema import ResourcesConfig\n")
    graph = {"megaflow.config.schema": set(_imports(schema, "megaflow.config")) & {"megaflow.config.layout"},
             "megaflow.config.layout": set(_imports(layout, "megaflow.config")) & {"megaflow.config.schema"}}
    assert cycles(graph) == [["megaflow.config.layout", "megaflow.config.schema"]]


def test_megaflow_has_no_import_circles():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_packages_import_only_the_layers_below(package):
    allowed = LAYERS[package] | {package}
    bad = {module: sorted(t for t in targets if not any(t == a or t.startswith(a + ".") for a in allowed))
           for module, targets in import_graph().items() if module == package or module.startswith(package + ".")}
    assert {m: t for m, t in bad.items() if t} == {}


def test_the_layers_exist():
    """A renamed package would make its contract vacuous."""
    assert set(LAYERS) <= set(_modules())
