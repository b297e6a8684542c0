"""Every leaf key of :class:`megaflow.config.Config` is consumed (a named test shows its effect)
or refused at load naming the key and what is supported (the table: ``key_coverage.py``).

A key added to the schema without a row fails :func:`test_every_leaf_key_has_a_row`. Fast: the
config tree is walked from the dataclass fields and the named tests are read with ``ast``,
never run here.
"""
from __future__ import annotations

import ast
import collections.abc
import dataclasses
import typing
from functools import cache
from pathlib import Path

import pytest

from key_coverage import GAPS, KEYS, Consumed, Refused
from megaflow.config import ConfigError
from megaflow.config.schema import Config
from megaflow.config.typed import Section
from megaflow.topology import load_run

ROOT = Path(__file__).resolve().parents[2]
#: The recipe the refusals are loaded over (CPU, the default run).
RECIPE = "tiny_arith_grpo"


def leaf_keys(cls: type[Section] = Config, prefix: str = "") -> list[str]:
    """Dotted leaf keys of a section, recursively from its dataclass fields; the fields of a
    ``Mapping[str, Section]`` (named pools) appear under ``*``."""
    hints, out = typing.get_type_hints(cls), []
    for field in dataclasses.fields(cls):
        hint, key = hints[field.name], f"{prefix}{field.name}"
        args = typing.get_args(hint)
        if isinstance(hint, type) and issubclass(hint, Section):
            out += leaf_keys(hint, key + ".")
        elif (typing.get_origin(hint) in (dict, collections.abc.Mapping) and len(args) == 2
              and isinstance(args[1], type) and issubclass(args[1], Section)):
            out += leaf_keys(args[1], key + ".*.")
        else:
            out.append(key)
    return out


LEAVES = leaf_keys()


def test_the_walk_finds_nested_and_mapped_sections():
    assert {"actor.optim.lr", "critic.optim.min_lr", "algorithm.kl_ctrl.horizon",
            "algorithm.rollout_correction.bypass", "resources.pools.*.nodes", "model.hf_config"} <= set(LEAVES)
    assert "actor.optim" not in LEAVES and "resources.pools" not in LEAVES
    assert len(LEAVES) == len(set(LEAVES)) > 150


def test_every_leaf_key_has_a_row():
    missing = [k for k in LEAVES if k not in KEYS and k not in GAPS]
    assert not missing, f"config keys with no row in tests/config/key_coverage.py: {', '.join(missing)}"


def test_no_row_names_a_key_that_does_not_exist_or_two_rows_one_key():
    unknown = sorted((set(KEYS) | set(GAPS)) - set(LEAVES))
    assert not unknown, f"rows for keys the config does not have: {', '.join(unknown)}"
    assert not set(KEYS) & set(GAPS), f"keys both covered and listed as gaps: {sorted(set(KEYS) & set(GAPS))}"


@cache
def _test_sources(path: str) -> dict[str, str]:
    """``{test function name: its source, decorators included}`` of a test file."""
    file = ROOT / path
    if not file.is_file():
        return {}
    text = file.read_text()
    lines, out = text.splitlines(), {}
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test"):
            start = min([d.lineno for d in node.decorator_list] + [node.lineno])
            out[node.name] = "\n".join(lines[start - 1:node.end_lineno])
    return out


CONSUMED = [(k, t) for k, row in KEYS.items() if isinstance(row, Consumed) for t in row.tests]


@pytest.mark.parametrize("key, node_id", CONSUMED, ids=[f"{k}-{t.split('::')[-1]}" for k, t in CONSUMED])
def test_consumed_rows_name_a_test_that_exists_and_mentions_the_key(key, node_id):
    path, _, name = node_id.partition("::")
    sources = _test_sources(path)
    assert name in sources, f"{key}: {node_id} does not exist"
    leaf = key.rsplit(".", 1)[-1]
    assert key in sources[name] or leaf in sources[name], f"{key}: {node_id} never mentions {key!r} or {leaf!r}"


def test_every_consumed_row_names_at_least_one_test():
    assert all(row.tests for row in KEYS.values() if isinstance(row, Consumed))


REFUSED = [(k, row) for k, row in KEYS.items() if isinstance(row, Refused)]


@pytest.mark.parametrize("key, row", REFUSED, ids=[k for k, _ in REFUSED])
def test_refused_keys_fail_at_load_naming_the_key_and_what_is_supported(key, row):
    with pytest.raises(ConfigError) as err:
        load_run(RECIPE, ["resources.use_gpu=false", *row.extra, f"{key}={row.value}"])
    assert err.value.key == key, str(err.value)
    assert row.supported in str(err.value), str(err.value)
