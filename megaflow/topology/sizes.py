"""Derived sizes of a config: what the knobs imply for each role, the rollout and the cluster.

Nothing here is stored in the config: each size is a small frozen object computed by a
pure function of the config, so the trainer and the workers read the same numbers and
nobody rescales a config in place. The same functions check what they compute: a
layout that does not divide raises :class:`ConfigError` naming the dotted key (and
:func:`megaflow.topology.validate.validate_config` calls them on every loaded config).

Vocabulary: a *sample* is one (prompt, response) pair; a step has
``data.train_batch_size * rollout.n`` samples. A *mini-batch* is one optimizer step; a
*micro-batch* is one forward/backward on one rank.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaflow.config.schema import ROLES, Config
from megaflow.config.typed import ConfigError, check, thaw
from megaflow.topology.model_spec import ModelSpec, model_spec, resolve_hf_config
from megaflow.topology.placement import pack_pools

TRAINED_ROLES = ("actor", "critic")


def enabled_roles(cfg: Config) -> tuple[str, ...]:
    """Roles that get a worker group: the actor always, the others when enabled."""
    return tuple(role for role in ROLES if role == "actor" or getattr(cfg, role).enabled)


def pools_in_use(cfg: Config) -> dict[str, tuple[str, ...]]:
    """Pools that host processes, in placement order: pool -> the enabled roles placed on
    it, plus ``"rollout"`` on the rollout's own pool under split placement. A disabled
    role's ``resources.placement`` entry is not read."""
    placement, by_pool = cfg.resources.placement, dict[str, list[str]]()
    for role in enabled_roles(cfg):
        by_pool.setdefault(getattr(placement, role), []).append(role)
    if cfg.algorithm.safe_rlhf.enable:  # Safe RLHF's cost critic: a second critic group on the critic's pool
        by_pool.setdefault(placement.critic, []).append("cost_critic")
    split = split_rollout_pool(cfg)
    if split is not None:
        by_pool.setdefault(split, []).append("rollout")
    return {pool: tuple(roles) for pool, roles in by_pool.items()}


def role_model_spec(cfg: Config, role: str) -> ModelSpec:
    """Architecture of ``role``: the reward model's own, the policy's for the others."""
    if role == "reward_model":
        rm = cfg.reward_model
        if rm.hf_config is not None or rm.path is not None:
            return model_spec(*resolve_hf_config(rm.path, rm.hf_config, "reward_model"))
    return model_spec(*resolve_hf_config(cfg.model.path, cfg.model.hf_config, "model"))


@dataclass(frozen=True)
class RoleParallel:
    """One role's Megatron mesh on its pool: ``world_size == tp * cp * dp * pp``; ``ep`` expert
    ranks are carved out of ``dp * cp`` (mixture-of-experts models)."""

    role: str
    pool: str
    world_size: int
    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int | None
    ep: int = 1


def uses_distributed_optimizer(cfg: Config, role: str) -> bool:
    """Whether trained ``role`` (actor, critic) runs megatron-core's distributed optimizer:
    ``<role>.use_distributed_optimizer``, or when it is null, whether the role's dp > 1 (the
    optimizer state is sharded over DP ranks; at dp = 1 the plain optimizer does the same
    updates without the flat parameter/gradient copies)."""
    chosen = getattr(cfg, role).use_distributed_optimizer
    return role_parallel(cfg, role).dp > 1 if chosen is None else bool(chosen)


def role_parallel(cfg: Config, role: str) -> RoleParallel:
    """The mesh of ``role`` (actor, ref, critic, reward_model); dp derived from its pool.

    Raises:
        ConfigError: the pool's world size is not a multiple of ``tp * pp * cp``.
    """
    section, res = getattr(cfg, role), cfg.resources
    pool = getattr(res.placement, role)
    world = res.pool_world_size(pool)
    model_ranks = section.tp * section.pp * section.cp
    check(world % model_ranks == 0, f"{role}.tp",
          f"{role} pool {pool!r} has {world} ranks ({{0}}: {res.pool_nodes(pool)} nodes x "
          f"{res.pool_procs_per_node(pool)}), not a multiple of tp*pp*cp = "
          f"{section.tp}*{section.pp}*{section.cp} = {model_ranks}; world size must be tp*pp*cp*dp exactly",
          f"resources.pools.{pool}")
    return RoleParallel(role=role, pool=pool, world_size=world, tp=section.tp, pp=section.pp,
                        cp=section.cp, dp=world // model_ranks, vpp=section.vpp, ep=section.ep)


@dataclass(frozen=True)
class GenerationSizes:
    """The HybridEngine's generation layout p_g-t_g-d_g-d (HybridFlow section 5)."""

    tp: int
    """t_g."""
    pp: int
    """p_g."""
    micro_dp: int
    """d_g = (t*p) / (t_g*p_g): generation replicas per training replica."""
    num_replicas: int
    """Generation replicas in the actor pool: d * cp * d_g (the generation mesh's dp size)."""
    samples_per_replica: int
    """Samples one replica generates per step (ceil; the dispatch pads the rest)."""


def generation_sizes(cfg: Config) -> GenerationSizes:
    """Generation layout of the rollout from the actor's training layout.

    Raises:
        ConfigError: ``actor.tp % rollout.tp`` or ``actor.pp % rollout.pp`` is non-zero, or
            ``rollout.pp > 1`` (not supported).
    """
    actor, rollout = role_parallel(cfg, "actor"), cfg.rollout
    check(actor.tp % rollout.tp == 0, "rollout.tp",
          f"generation TP t_g={rollout.tp} must divide {{0}}={actor.tp} (HybridEngine: t % t_g == 0)", "actor.tp")
    check(actor.pp % rollout.pp == 0, "rollout.pp",
          f"generation PP p_g={rollout.pp} must divide {{0}}={actor.pp} (p % p_g == 0)", "actor.pp")
    # The vLLM engine is built without pipeline parallelism: at p_g > 1 each rank would push
    # only its stage's layers and the others would keep the engine's dummy weights.
    check(rollout.pp == 1, "rollout.pp",
          f"pipeline-parallel generation is not supported: use 1 (the actor's {actor.pp} stages fold into "
          f"generation replicas), got {rollout.pp}")
    micro_dp = (actor.tp * actor.pp) // (rollout.tp * rollout.pp)
    replicas = actor.dp * actor.cp * micro_dp
    if split_rollout_pool(cfg) is not None:  # split placement: the rollout pool's replicas generate
        replicas = _check_split_rollout_pool(cfg) // rollout.tp
    return GenerationSizes(tp=rollout.tp, pp=rollout.pp, micro_dp=micro_dp, num_replicas=replicas,
                           samples_per_replica=-(-num_samples_per_step(cfg) // replicas))


@dataclass(frozen=True)
class TrainBatchSizes:
    """How one step's samples are split for a trained role's update."""

    num_samples: int
    """Samples per step (data.train_batch_size x rollout.n)."""
    mini_batch_size: int
    """Samples per mini-batch (one optimizer step), across all DP ranks."""
    num_mini_batches: int
    """Mini-batches per PPO epoch."""
    num_optimizer_steps: int
    """Optimizer steps per training step (mini-batches x ppo_epochs)."""
    mini_batch_size_per_dp_rank: int
    """Samples of one mini-batch on one DP rank."""
    micro_batch_size: int
    """Samples per forward/backward on one rank."""
    num_micro_batches: int
    """Micro-batches per mini-batch on one rank (gradient-accumulation steps)."""
    max_seq_len: int
    """data.max_prompt_length + rollout.response_length."""
    max_tokens_per_mini_batch: int
    """Upper bound of the global token count of one mini-batch (all DP ranks)."""


def split_rollout_pool(cfg: Config) -> str | None:
    """The rollout's own pool under split placement (``resources.placement.rollout`` naming
    a pool other than the actor's), else None (colocated with the actor)."""
    placement = cfg.resources.placement
    return placement.rollout if placement.rollout not in (None, placement.actor) else None


def rollout_sleep_level(cfg: Config) -> int:
    """``rollout.sleep_level``, null resolved: 2 when colocated, 1 under split placement."""
    if cfg.rollout.sleep_level is not None:
        return cfg.rollout.sleep_level
    return 1 if split_rollout_pool(cfg) is not None else 2


def _check_split_rollout_pool(cfg: Config) -> int:
    """Split placement's rules; returns the rollout pool's ranks.

    Raises:
        ConfigError: the pool's ranks are not a positive multiple of ``rollout.tp``, or
            another role shares the pool (its processes hold engines only), or
            ``rollout.sleep_level=2`` (nothing would restore the discarded weights).
    """
    pool, res = split_rollout_pool(cfg), cfg.resources
    if pool is None:
        raise ValueError("split placement's rules checked without a rollout pool of its own")
    world = res.pool_world_size(pool)
    check(world >= cfg.rollout.tp and world % cfg.rollout.tp == 0, "resources.placement.rollout",
          f"rollout pool {pool!r} has {world} ranks, not a positive multiple of {{0}}={cfg.rollout.tp} "
          f"(each engine replica needs t_g ranks)", "rollout.tp", f"resources.pools.{pool}")
    for role in enabled_roles(cfg):
        check(getattr(res.placement, role) != pool, f"resources.placement.{role}",
              f"pool {pool!r} is the rollout's own pool (resources.placement.rollout): its ranks hold only "
              f"engines; place {role} on another pool")
    check(cfg.rollout.sleep_level != 2, "rollout.sleep_level",
          "2 discards the engine's weights after each generation, but under split placement ({0}) a sync "
          "sends nothing when the actor is unchanged: use 1 or null", "resources.placement.rollout")
    return world


def num_samples_per_step(cfg: Config) -> int:
    """Samples (prompt x response pairs) generated and trained on per step."""
    return cfg.data.train_batch_size * cfg.rollout.n


def max_seq_len(cfg: Config) -> int:
    """Longest prompt + response a step can produce, in tokens."""
    return cfg.data.max_prompt_length + cfg.rollout.response_length


def train_batch_sizes(cfg: Config, role: str) -> TrainBatchSizes:
    """Mini-/micro-batch split of the update of ``role`` ('actor' or 'critic').

    Raises:
        ConfigError (at ``<role>.ppo_mini_batch_size`` or
        ``<role>.ppo_micro_batch_size_per_gpu``): the step's prompts do not split into
        whole mini-batches, a mini-batch does not split over the DP ranks, or a rank's
        share does not split into whole micro-batches.
    """
    section, par = getattr(cfg, role), role_parallel(cfg, role)
    n, prompts = cfg.rollout.n, cfg.data.train_batch_size
    mini_key, micro_key = f"{role}.ppo_mini_batch_size", f"{role}.ppo_micro_batch_size_per_gpu"
    check(prompts % section.ppo_mini_batch_size == 0, mini_key,
          f"{{0}}={prompts} prompts per step do not split into mini-batches of "
          f"{section.ppo_mini_batch_size} prompts", "data.train_batch_size")
    mini = section.ppo_mini_batch_size * n
    check(mini % par.dp == 0, mini_key,
          f"a mini-batch of {section.ppo_mini_batch_size} prompts x rollout.n={n} = {mini} samples "
          f"does not split over {role} dp={par.dp} (pool {par.pool!r}: {par.world_size} ranks / tp*pp*cp)")
    per_rank = mini // par.dp
    check(section.use_dynamic_bsz or per_rank % section.ppo_micro_batch_size_per_gpu == 0, micro_key,
          f"{per_rank} samples per DP rank per mini-batch do not split into micro-batches of "
          f"{section.ppo_micro_batch_size_per_gpu}")
    num_mini = prompts // section.ppo_mini_batch_size
    seq = max_seq_len(cfg)
    return TrainBatchSizes(
        num_samples=prompts * n, mini_batch_size=mini, num_mini_batches=num_mini,
        num_optimizer_steps=num_mini * section.ppo_epochs, mini_batch_size_per_dp_rank=per_rank,
        micro_batch_size=section.ppo_micro_batch_size_per_gpu,
        num_micro_batches=per_rank // section.ppo_micro_batch_size_per_gpu,
        max_seq_len=seq, max_tokens_per_mini_batch=mini * seq)


def num_training_steps(cfg: Config, num_train_prompts: int) -> int:
    """Training steps of the run: ``trainer.total_steps``, or ``total_epochs`` x the whole
    batches of ``num_train_prompts`` (the last partial batch of an epoch is dropped).

    Raises:
        ValueError: the dataset holds fewer prompts than one batch.
    """
    if cfg.trainer.total_steps is not None:
        return cfg.trainer.total_steps
    per_epoch = num_train_prompts // cfg.data.train_batch_size
    if per_epoch == 0:
        raise ConfigError("data.train_batch_size", f"{cfg.data.train_batch_size} prompts per step but the "
                                                   f"training set has only {num_train_prompts}")
    return per_epoch * cfg.trainer.total_epochs


#: role -> (update budget key or None, forward budget key) of the token-budget micro-batches
TOKEN_BUDGET_KEYS = {"actor": ("ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu"),
                     "critic": ("ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu"),
                     "ref": (None, "log_prob_max_token_len_per_gpu")}


def token_budgets(cfg: Config, role: str) -> tuple[int | None, int | None]:
    """``(update, forward)`` padded-token budgets per micro-batch of ``role`` with
    ``use_dynamic_bsz``; ``(None, None)`` without (fixed row counts).

    Raises:
        ConfigError (at ``<role>.<budget key>``): a budget below the longest possible
            sequence (``data.max_prompt_length + rollout.response_length``).
    """
    section = getattr(cfg, role)
    if role not in TOKEN_BUDGET_KEYS or not section.use_dynamic_bsz:
        return None, None
    out: list[int | None] = []
    for key in TOKEN_BUDGET_KEYS[role]:
        if key is None:
            out.append(None)
            continue
        budget = getattr(section, key)
        check(budget >= max_seq_len(cfg), f"{role}.{key}",
              f"{{0}}={budget} tokens cannot hold the longest sequence: data.max_prompt_length + "
              f"rollout.response_length = {max_seq_len(cfg)}", f"{role}.{key}")
        out.append(budget)
    return out[0], out[1]


def run_dir_of(cfg: Config) -> Path:
    """The run directory ``<trainer.output_dir>/<project_name>/<experiment_name>`` (``~`` expanded)."""
    tr = cfg.trainer
    return Path(tr.output_dir).expanduser() / tr.project_name / tr.experiment_name


def lr_schedule_steps(cfg: Config, role: str, total_steps: int) -> int:
    """Optimizer step at which ``role``'s LR decay reaches ``min_lr`` (megatron-core's
    ``lr_decay_steps``, counted from the first update, warm-up included).

    ``<role>.optim.lr_decay_steps`` when set, else the run's last optimizer step:
    ``total_steps`` x :attr:`TrainBatchSizes.num_optimizer_steps` (mini-batches x PPO epochs
    of one training step). With ``constant`` decay the value only has to exceed the warm-up.

    Args:
        cfg: the loaded config.
        role: ``"actor"`` or ``"critic"``.
        total_steps: training steps of the run (:func:`num_training_steps`).

    Raises:
        ConfigError (at ``<role>.optim.lr_warmup_steps``): a decaying schedule whose warm-up
            lasts as long as the whole run (the decay would never start).
    """
    optim = getattr(cfg, role).optim
    if optim.lr_decay_steps is not None:
        return optim.lr_decay_steps
    run_updates = total_steps * train_batch_sizes(cfg, role).num_optimizer_steps
    if optim.lr_decay_style == "constant":
        return max(run_updates, optim.lr_warmup_steps + 1)
    check(run_updates > optim.lr_warmup_steps, f"{role}.optim.lr_warmup_steps",
          f"{{0}}={optim.lr_warmup_steps} warm-up updates leave no room for the {optim.lr_decay_style!r} decay: "
          f"the run has {run_updates} optimizer steps ({total_steps} training steps)", "trainer.total_steps")
    return run_updates


#: role -> (update micro-batch key or None, forward micro-batch key): samples per micro-batch
MICRO_BATCH_KEYS = {"actor": ("ppo_micro_batch_size_per_gpu", "log_prob_micro_batch_size_per_gpu"),
                    "critic": ("ppo_micro_batch_size_per_gpu", "forward_micro_batch_size_per_gpu"),
                    "ref": (None, "log_prob_micro_batch_size_per_gpu"),
                    "reward_model": (None, "micro_batch_size_per_gpu")}


@dataclass(frozen=True)
class MicroBatchSizes:
    """How one role's engine cuts a rank's rows into micro-batches (one forward/backward each)."""

    max_seq_len: int
    """Longest accepted sequence in real tokens (:func:`max_seq_len`)."""
    update_micro_batch_size: int | None
    """Samples per micro-batch of an update; None for the roles that do not train."""
    forward_micro_batch_size: int
    """Samples per micro-batch of a forward-only pass."""
    update_max_tokens: int | None
    """With ``use_dynamic_bsz``: padded tokens per micro-batch of an update (replaces the row count)."""
    forward_max_tokens: int | None
    """With ``use_dynamic_bsz``: padded tokens per micro-batch of a forward pass."""


def micro_batch_sizes(cfg: Config, role: str) -> MicroBatchSizes:
    """Micro-batch sizes of ``role``'s engine, from the ``*_micro_batch_size_per_gpu`` keys
    (:data:`MICRO_BATCH_KEYS`) and the token budgets (:func:`token_budgets`).

    Raises:
        ConfigError: a token budget below the longest sequence (see :func:`token_budgets`).
        KeyError: ``role`` is not one of :data:`~megaflow.config.schema.ROLES`.
    """
    section = getattr(cfg, role)
    update_key, forward_key = MICRO_BATCH_KEYS[role]
    update_budget, forward_budget = token_budgets(cfg, role)
    return MicroBatchSizes(max_seq_len=max_seq_len(cfg),
                           update_micro_batch_size=None if update_key is None else getattr(section, update_key),
                           forward_micro_batch_size=getattr(section, forward_key),
                           update_max_tokens=update_budget, forward_max_tokens=forward_budget)


@dataclass(frozen=True)
class ModelSource:
    """Where a role's architecture and initial weights come from."""

    path: str | None
    """HF checkpoint directory (``~`` expanded) holding config.json and the weights; None:
    random initialisation from ``hf_config``."""
    hf_config: Mapping[str, Any] | None
    """The inline HF config, used only when ``path`` is None."""
    key: str
    """Dotted config key of the source (for error messages)."""


def model_source(cfg: Config, role: str) -> ModelSource:
    """The model of ``role``: ``reward_model.path``/``hf_config`` for the reward model,
    ``critic.path`` (when set) for the critic, else ``model.path``/``model.hf_config``.
    A path wins over an inline config (which the planner checks against its config.json)."""
    path, inline, key = cfg.model.path, cfg.model.hf_config, "model"
    if role == "reward_model":
        path, inline, key = cfg.reward_model.path, cfg.reward_model.hf_config, "reward_model"
    elif role == "critic" and cfg.critic.path is not None:
        path, inline, key = cfg.critic.path, None, "critic"
    if path is not None:
        return ModelSource(path=os.path.expanduser(path), hf_config=None, key=f"{key}.path")
    return ModelSource(path=None, hf_config=inline, key=f"{key}.hf_config")


def role_hf_config(cfg: Config, role: str) -> dict[str, Any]:
    """The HF config (plain, mutable dict) of ``role``'s model (:func:`model_source`):
    ``<path>/config.json``, or the inline config.

    Raises:
        ConfigError: the path has no readable config.json (naming the key).
    """
    source = model_source(cfg, role)
    if source.path is not None:
        on_disk, _ = resolve_hf_config(source.path, None, source.key.rpartition(".")[0])
        return dict(on_disk)
    return thaw(source.hf_config)


@dataclass(frozen=True)
class ClusterRequirements:
    """What the cluster must offer (Ray / Slurm): nodes x ranks, each rank its CPUs/GPU."""

    nodes: int
    procs_per_node: int
    gpus_per_node: int
    cpus_per_node: int


def cluster_requirements(cfg: Config) -> ClusterRequirements:
    """Nodes and per-node resources the run needs: the nodes of the pools in use
    (:func:`pools_in_use`), as packed on resources.nodes."""
    res = cfg.resources

    in_use = pools_in_use(cfg)
    used_nodes = {node for name, pool in pack_pools(res).items() if name in in_use for node in pool.nodes}
    procs = res.procs_per_node
    return ClusterRequirements(nodes=len(used_nodes), procs_per_node=procs,
                               gpus_per_node=procs if res.use_gpu else 0,
                               cpus_per_node=procs * res.num_cpus_per_proc)


__all__ = [
    "RoleParallel", "GenerationSizes", "TrainBatchSizes", "ClusterRequirements", "enabled_roles", "pools_in_use",
    "role_model_spec", "role_parallel", "generation_sizes", "train_batch_sizes", "num_samples_per_step",
    "max_seq_len", "run_dir_of", "num_training_steps", "lr_schedule_steps", "token_budgets", "TOKEN_BUDGET_KEYS",
    "cluster_requirements", "TRAINED_ROLES",
    "MICRO_BATCH_KEYS", "MicroBatchSizes", "micro_batch_sizes", "ModelSource", "model_source", "role_hf_config",
    "split_rollout_pool",
]
