"""The one way a run gets its config: build it (:mod:`megaflow.config.loader`), then check
what spans sections (:func:`megaflow.topology.validate.validate_config`).

The trainer, the dry run, the launchers, the tools and the tests load through
:func:`load_run` (or :func:`run_from_dict` for a tree already in memory), so a config that
reaches a worker has passed every check, and bad input is refused before any process starts.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from megaflow.config.loader import config_from_dict, in_inputs, load_config, resolve_recipe
from megaflow.config.overrides import split_override
from megaflow.config.schema import Config
from megaflow.config.typed import ConfigError
from megaflow.topology.validate import validate_config


def load_run(recipe: str | Path, overrides: Iterable[str] = ()) -> Config:
    """Load a recipe (name in ``recipes/`` or a YAML path) with ``key.sub=value`` overrides
    and validate it across sections.

    Args:
        recipe: ``"tiny_arith_grpo"`` or a path such as a checkpoint's ``config.yaml``.
        overrides: command-line assignments, applied in order after the recipe.

    Returns:
        The validated, frozen :class:`Config`.

    Raises:
        FileNotFoundError: unknown recipe (lists the shipped ones).
        ConfigError: (a ``ValueError``) unknown key with close matches, wrong type
            (key, expected type, value), invalid value or impossible topology; the
            message names the dotted key and the inputs that set the keys it names: the
            recipe file, the command-line overrides
            (:func:`~megaflow.config.loader.in_inputs`).
    """
    path = resolve_recipe(recipe)
    overrides = list(overrides)
    cfg = load_config(path, overrides)  # refuses a malformed override before its key is read below
    try:
        validate_config(cfg, frozenset(".".join(split_override(item)[1]) for item in overrides))
    except ConfigError as err:
        raise in_inputs(err, path, overrides) from None
    return cfg


def run_from_dict(data: Mapping[str, Any]) -> Config:
    """Build a :class:`Config` from a nested dict over the defaults and validate it across
    sections (a checkpoint's tree, a tree built in memory).

    Raises:
        ConfigError: unknown key, wrong type, invalid value or impossible topology, with the
            dotted key.
    """
    cfg = config_from_dict(data)
    validate_config(cfg)
    return cfg


__all__ = ["load_run", "run_from_dict"]
