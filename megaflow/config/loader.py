"""Building a :class:`~megaflow.config.schema.Config`: defaults <- recipe YAML <- ``key.sub=value`` overrides.

This module builds the config tree and checks each section on its own; it does nothing
else. A run loads through :func:`megaflow.topology.load_run`, which builds with
:func:`load_config` and then runs the checks that span sections.

Layers, lowest first: the dataclass defaults (:mod:`megaflow.config.schema`),
``trainer.experiment_name`` = the recipe's file name, the recipe file, then the command
line overrides in order. Mappings merge key by key, in a recipe layer and in an override
alike (``model.hf_config={num_hidden_layers: 4}`` changes that one field and keeps the
recipe's others); any other value (scalar, list) replaces. Override values are typed as
YAML scalars (``3`` int, ``1e-6``/``0.1`` float, ``true`` bool, ``null``, ``[a, b]`` list,
``{k: v}`` mapping, anything else a string).

Refused as :class:`ConfigError` naming the key: an override without a value
(``trainer.total_steps=``, most often a shell variable that expanded to nothing: null is
written ``=null``, which passes ``make train`` and the shell unchanged) and a key
given twice in one mapping of a recipe file (the file and both lines are named), since
YAML would otherwise keep the second silently. A file or an override value that is not
valid YAML is refused on one line naming the file (or the override) and the line and
column. An error about a key ends with the input that gave it its value
(:func:`in_inputs`): ``[override K=V]``, ``[recipe <path>]`` or both.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from megaflow.config.overrides import key_parts, parse_value, split_override, yaml_error_text
from megaflow.config.schema import Config
from megaflow.config.typed import ConfigError, build_section

RECIPES_DIR = Path(__file__).resolve().parents[2] / "recipes"


def list_recipes(recipes_dir: Path = RECIPES_DIR) -> list[str]:
    """Names of the recipes shipped in ``recipes/`` (file stems), sorted."""
    return sorted(p.stem for p in recipes_dir.glob("*.yaml"))


def resolve_recipe(recipe: str | Path, recipes_dir: Path = RECIPES_DIR) -> Path:
    """A recipe name (``tiny_arith_grpo``) or a path to a YAML file -> the file.

    Raises:
        FileNotFoundError: no such recipe; the message lists the shipped ones, closest first.
    """
    path = Path(recipe).expanduser()
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise FileNotFoundError(f"recipe file {path} does not exist")
        return path
    candidate = recipes_dir / f"{recipe}.yaml"
    if candidate.is_file():
        return candidate
    import difflib

    names = list_recipes(recipes_dir)
    close = difflib.get_close_matches(str(recipe), names, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    raise FileNotFoundError(f"unknown recipe {str(recipe)!r}{hint} (recipes in {recipes_dir}: {', '.join(names)})")


def _check_unique_keys(node: yaml.Node, path: Path, prefix: str = "", seen: set[int] | None = None) -> None:
    """Raise ConfigError for a key given twice in one mapping of the composed YAML ``node``."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias of a node already checked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # "<<: *anchor": later keys override on purpose
                _check_unique_keys(value_node, path, prefix, seen)
                continue
            name = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else None
            dotted = ".".join(p for p in (prefix, name or "?") if p)
            if name is not None:
                line = key_node.start_mark.line + 1
                if name in lines:
                    raise ConfigError(dotted, f"given twice in {path} (lines {lines[name]} and {line}); "
                                              "YAML would keep only the second: remove one")
                lines[name] = line
            _check_unique_keys(value_node, path, dotted, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _check_unique_keys(item, path, f"{prefix}[{i}]", seen)


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping (an empty file is ``{}``).

    Raises:
        ConfigError: invalid YAML or text that is not UTF-8 (one line naming the file, the line
            and the column: :func:`~megaflow.config.overrides.yaml_error_text`), a key given
            twice in one mapping (dotted key, file and both lines named) or a top level that is
            not a mapping (names the file).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError("", f"{path}: not UTF-8 text: byte {err.object[err.start]:#04x} at offset {err.start} "
                              f"({err.reason})") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            _check_unique_keys(node, path)
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError("", f"{path}: invalid YAML at {yaml_error_text(err, text, file=True)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("", f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def merge(base: Mapping[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, any other value in ``update`` replaces."""
    out = copy.deepcopy(dict(base))
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def parse_override(item: str) -> tuple[str, Any]:
    """``"actor.optim.lr=1e-6"`` -> ``("actor.optim.lr", 1e-6)`` (value typed as YAML; the key
    syntax, quoted key parts and the checks of mapping values: :mod:`megaflow.config.overrides`).

    Raises:
        ConfigError: no ``=``, a malformed key, an empty value (``key=``: null is written
            ``key=null``; the shell strips quotes, so a typed ``key=''`` arrives as ``key=``
            too) or a value that is not valid YAML.
    """
    key, _, raw = split_override(item)
    if not raw.strip():
        raise ConfigError(key, f"override {item!r} has no value; write {key}=null for null, or the value "
                               "itself (an empty value is refused: it is most often a shell variable that "
                               "expanded to nothing)")
    value = parse_value(key, raw)
    return key, value


def apply_override(tree: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """A copy of ``tree`` with the dotted ``key`` set to ``value`` (mappings created as needed).

    A mapping ``value`` over a mapping already at ``key`` merges into it key by key
    (:func:`merge`); any other value replaces what is there.

    Raises:
        ConfigError: a prefix of ``key`` holds a value that is not a mapping.
    """
    out = copy.deepcopy(tree)
    node, parts = out, key_parts(key)
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(".".join(parts[: i + 1]), f"is {child!r}, not a section: cannot set {key!r} inside it")
        node = child
    last = parts[-1]
    if isinstance(value, Mapping) and isinstance(node.get(last), Mapping):
        node[last] = merge(node[last], value)
    else:
        node[last] = value
    return out


def config_from_dict(data: Mapping[str, Any]) -> Config:
    """Build a :class:`Config` from a nested dict over the defaults, each section validated
    on its own (the cross-section checks: :func:`megaflow.topology.run_from_dict`).

    Raises:
        ConfigError: unknown key, wrong type or invalid value, with the dotted key.
    """
    return build_section(Config, data)


def load_config(recipe: str | Path, overrides: Iterable[str] = ()) -> Config:
    """Load a recipe (name in ``recipes/`` or a YAML path) with ``key.sub=value`` overrides.

    Args:
        recipe: ``"tiny_arith_grpo"`` or a path such as a checkpoint's ``config.yaml``.
        overrides: command-line assignments, applied in order after the recipe.

    Returns:
        The frozen :class:`Config`, each section validated on its own (the checks across
        sections: :func:`megaflow.topology.load_run`).

    Raises:
        FileNotFoundError: unknown recipe (lists the shipped ones).
        ConfigError: (a ``ValueError``) unknown key with close matches, wrong type
            (key, expected type, value) or invalid value; the message names the dotted key
            and the input that set it, the recipe file or the override (:func:`in_inputs`).
    """
    path = resolve_recipe(recipe)
    tree = merge({"trainer": {"experiment_name": path.stem}}, read_yaml(path))
    overrides = list(overrides)
    for i, item in enumerate(overrides):
        key, value = parse_override(item)  # its errors name the override already
        try:
            tree = apply_override(tree, key, value)
        except ConfigError as err:
            raise in_inputs(err, path, overrides[:i + 1]) from None
    try:
        return config_from_dict(tree)
    except ConfigError as err:
        raise in_inputs(err, path, overrides) from None


def in_inputs(err: ConfigError, path: Path, overrides: Sequence[str] = ()) -> ConfigError:
    """``err`` with the inputs that gave its key at the end of its message, so the user knows
    which one to change: ``[override K=V]`` when command-line overrides (of ``overrides``, in
    order) replaced the recipe's value of ``err.key`` whole; otherwise ``recipe <path>`` (the
    recipe's value or the default, an override of a mapping merging into the recipe's)
    after the overrides that set part of ``err.key`` or one of the keys the message refers
    to (``err.related``), e.g. ``[override data.train_files=[a.jsonl]; recipe x.yaml]``.
    """
    recipe = read_yaml(path) if overrides else {}
    setters, replaced = _overrides_of(err.key, recipe, overrides) if err.key else ([], False)
    tags = dict.fromkeys(setters)
    if not replaced:
        for key in err.related:
            tags.update(dict.fromkeys(_overrides_of(key, recipe, overrides)[0] if key else []))
    where = [f"override {item}" for item in tags] + ([] if replaced else [f"recipe {path}"])
    return type(err)(err.key, f"{err.message} [{'; '.join(where)}]", err.related)


def _overrides_of(key: str, recipe: dict[str, Any], overrides: Sequence[str]) -> tuple[list[str], bool]:
    """The overrides that give the dotted ``key`` of the ``recipe`` tree its value, in order,
    and whether one of them replaced the value whole (an override of ``key`` or of a key
    above it, unless it merged a mapping into a mapping; the overrides before the last such
    one no longer count). An override of a key inside ``key`` sets part of it."""
    setters: list[str] = []
    replaced = False
    tree = recipe
    for item in overrides:
        written, value = parse_override(item)
        name = ".".join(key_parts(written))
        found, given = _at({name: value}, key)
        if found and not (isinstance(given, Mapping) and isinstance(_at(tree, key)[1], Mapping)):
            setters, replaced = [item], True
        elif found or name.startswith(key + "."):
            setters.append(item)
        try:
            tree = apply_override(tree, written, value)
        except ConfigError:  # the override refused (the error being tagged): no later one was applied
            break
    return setters, replaced


def _at(tree: Any, key: str) -> tuple[bool, Any]:
    """Whether the nested mappings ``tree`` hold the dotted ``key``, and its value there.
    Mapping keys may hold dots (``reward.reward_kwargs."my.source"``): a part is matched
    against the mapping's keys as a whole."""
    rest, node = key, tree
    while isinstance(node, Mapping):
        for part, child in node.items():
            if rest == str(part):
                return True, child
            if rest.startswith(f"{part}."):
                rest, node = rest[len(str(part)) + 1:], child
                break
        else:
            return False, None
    return False, None


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The full config (every field, defaults included) as plain YAML-safe data."""
    return cfg.to_dict()


def dump_config(cfg: Config, path: str | Path | None = None) -> str:
    """The full config as YAML (written to ``path`` when given); ``load_config`` reads it back."""
    text = yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=None)
    if path is not None:
        Path(path).write_text(text)
    return text
