"""Real configs for worker, engine and rollout tests.

Tests build what a worker reads, a :class:`~megaflow.topology.role_spec.RoleSpec`, from a
shipped recipe with ``key.sub=value`` overrides (as ``make train`` does), optionally with
the test's own HF architecture in place of the recipe's model, so every setting a test
relies on is visible in the test and goes through the config's validation.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

from megaflow.config import Config
from megaflow.topology import run_from_dict
from megaflow.topology.role_spec import RoleSpec

RECIPE = "tiny_arith_grpo"


def seq_len_overrides(max_seq_len: int, response_length: int = 4) -> list[str]:
    """Overrides giving ``data.max_prompt_length + rollout.response_length == max_seq_len``."""
    return [f"data.max_prompt_length={max_seq_len - response_length}", f"rollout.response_length={response_length}"]


def test_config(overrides: Iterable[str] = (), *, hf_config: Any = None, recipe: str = RECIPE,
                sections: Mapping[str, Mapping[str, Any]] | None = None) -> Config:
    """``recipe`` with ``overrides`` (as :func:`megaflow.topology.load_run` applies them);
    ``hf_config`` (an HF config object or dict) replaces ``model.hf_config`` as a whole;
    ``sections`` (``{"critic": {"path": ...}}``) are set last. Validated once, at the end.

    Raises:
        ConfigError: the result is not a valid config (naming the key).
    """
    from megaflow.config.loader import apply_override, merge, parse_override, read_yaml, resolve_recipe

    path = resolve_recipe(recipe)
    tree = merge({"trainer": {"experiment_name": path.stem}}, read_yaml(path))
    for item in overrides:
        tree = apply_override(tree, *parse_override(item))
    if hf_config is not None:
        values = hf_config if isinstance(hf_config, Mapping) else hf_config.to_dict()
        tree.setdefault("model", {})["hf_config"] = {k: v for k, v in values.items() if v is not None}
    for name, values in (sections or {}).items():
        tree.setdefault(name, {}).update(values)
    return run_from_dict(tree)


test_config.__test__ = False  # a helper, not a test


def role_spec(role: str, overrides: Iterable[str] = (), *, training_steps: int | None = None,
              **kwargs: Any) -> RoleSpec:
    """The :class:`RoleSpec` of ``role`` over :func:`test_config` (``kwargs`` go there);
    ``training_steps`` defaults to the recipe's ``trainer.total_steps``."""
    cfg = test_config(overrides, **kwargs)
    return RoleSpec(cfg, role, training_steps or cfg.trainer.total_steps)
