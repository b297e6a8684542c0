"""megaflow's configuration: typed frozen sections, recipes, derived sizes, dry-run plans.

    cfg = load_config("tiny_arith_grpo", ["trainer.total_steps=5"])
    print(format_plan(build_plan(cfg)))

Modules: :mod:`~megaflow.config.schema` (the sections and their defaults),
:mod:`~megaflow.config.loader` (recipes and overrides), :mod:`~megaflow.config.topology`
(derived sizes, cross-section checks), :mod:`~megaflow.config.plan` and
:mod:`~megaflow.config.report` (the dry run).
"""
from megaflow.config.loader import config_from_dict, config_to_dict, dump_config, list_recipes, load_config
from megaflow.config.plan import Plan, PlanError, build_plan
from megaflow.config.report import format_plan
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
from megaflow.config.topology import (
    cluster_requirements,
    enabled_roles,
    generation_sizes,
    lr_schedule_steps,
    num_samples_per_step,
    num_training_steps,
    role_model_spec,
    role_parallel,
    train_batch_sizes,
)
from megaflow.config.typed import ConfigError, ConfigTypeError

__all__ = [
    "load_config", "config_from_dict", "config_to_dict", "dump_config", "list_recipes", "build_plan",
    "format_plan", "Plan", "PlanError", "Config", "ModelConfig", "DataConfig", "AlgorithmConfig", "ActorConfig",
    "RolloutConfig", "RefConfig", "CriticConfig", "RewardModelConfig", "TrainerConfig", "ResourcesConfig",
    "ConfigError", "ConfigTypeError", "enabled_roles", "role_parallel", "role_model_spec", "generation_sizes",
    "train_batch_sizes", "num_samples_per_step", "num_training_steps", "lr_schedule_steps", "cluster_requirements",
]
