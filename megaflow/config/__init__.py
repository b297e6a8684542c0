"""megaflow's knobs: the typed, frozen config tree and how a recipe becomes one.

    cfg = load_config("tiny_arith_grpo", ["trainer.total_steps=5"])

Modules: :mod:`~megaflow.config.schema` (every section of the tree, its fields and their
defaults), :mod:`~megaflow.config.typed` (coercion, frozen sections, errors naming the
dotted key), :mod:`~megaflow.config.loader` (recipes and overrides). A config built here
has each section checked on its own; what a config implies (sizes, placement, the checks
across sections) is :mod:`megaflow.topology`, whose :func:`~megaflow.topology.load_run`
is how a run loads its config.
"""
from megaflow.config.loader import config_from_dict, config_to_dict, dump_config, list_recipes, load_config
from megaflow.config.schema import (
    ActorConfig,
    AlgorithmConfig,
    Config,
    CriticConfig,
    DataConfig,
    ModelConfig,
    RefConfig,
    ResourcesConfig,
    RewardModelConfig,
    RolloutConfig,
    TrainerConfig,
)
from megaflow.config.typed import ConfigError, ConfigTypeError

__all__ = [
    "load_config", "config_from_dict", "config_to_dict", "dump_config", "list_recipes", "Config", "ModelConfig",
    "DataConfig", "AlgorithmConfig", "ActorConfig", "RolloutConfig", "RefConfig", "CriticConfig",
    "RewardModelConfig", "TrainerConfig", "ResourcesConfig", "ConfigError", "ConfigTypeError",
]
