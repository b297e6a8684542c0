"""What a config implies, torch-free: the model it names, the sizes it derives, the checks
that span its sections, where its ranks go, and what each worker role reads.

    cfg = load_run("tiny_arith_grpo", ["trainer.total_steps=5"])
    generation_sizes(cfg).num_replicas

Modules: :mod:`~megaflow.topology.run` (:func:`load_run`, the one way a run loads and
validates its config), :mod:`~megaflow.topology.validate` (the checks across sections),
:mod:`~megaflow.topology.sizes` (derived sizes), :mod:`~megaflow.topology.model_spec`
(HF architectures, parameter counts), :mod:`~megaflow.topology.placement` (pools on nodes,
Megatron's groups), :mod:`~megaflow.topology.hybrid_layout` and
:mod:`~megaflow.topology.split_layout` (the generation layouts, colocated and split),
:mod:`~megaflow.topology.role_spec` (:class:`RoleSpec`, what one worker role reads).
It imports only :mod:`megaflow.config`; the dry run (:mod:`megaflow.dryrun`), the
HybridEngine, the workers and the trainer build on it.
"""
from megaflow.topology.role_spec import RoleSpec
from megaflow.topology.run import load_run, run_from_dict
from megaflow.topology.sizes import (
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
from megaflow.topology.validate import validate_config

__all__ = [
    "load_run", "run_from_dict", "validate_config", "RoleSpec", "enabled_roles", "role_parallel",
    "role_model_spec", "generation_sizes", "train_batch_sizes", "num_samples_per_step", "num_training_steps",
    "lr_schedule_steps", "cluster_requirements",
]
