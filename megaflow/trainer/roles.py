"""From a config to running worker groups: pools, colocation, per-role worker settings.

Roles placed on the same pool (``resources.placement``) share one Ray actor process per
rank (composed with :func:`~megaflow.single_controller.create_colocated_worker_cls`), so
they share that process's accelerator and torch.distributed world; the rollout always
lives inside the actor's processes (:class:`~megaflow.workers.actor_rollout.ActorRolloutWorker`).
"""
from __future__ import annotations

import os
from typing import Any

from megaflow.trainer.ppo_trainer import WorkerGroups

#: config section -> (worker class path, spawn prefix)
_ROLE_CLASSES = {
    "actor": "megaflow.workers.actor_rollout:ActorRolloutWorker",
    "ref": "megaflow.workers.megatron_workers:RefWorker",
    "critic": "megaflow.workers.megatron_workers:CriticWorker",
    "reward_model": "megaflow.workers.megatron_workers:RewardModelWorker",
}


def _import(path: str):
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def _engine_config(cfg, role: str, *, micro: int | None, forward_micro: int | None,
                   lr_decay_steps: int | None = None):
    from megaflow.config.topology import max_seq_len, token_budgets
    from megaflow.megatron.engine_config import EngineConfig

    section = getattr(cfg, role)
    optim = getattr(section, "optim", None)
    update_budget, forward_budget = token_budgets(cfg, role)
    kwargs: dict[str, Any] = dict(max_seq_len=max_seq_len(cfg), max_tokens_per_micro_batch=update_budget,
                                  forward_max_tokens_per_micro_batch=forward_budget,
                                  logits_chunk_tokens=getattr(section, "logits_chunk_tokens", None))
    if micro is not None:
        kwargs["micro_batch_size"] = micro
    if forward_micro is not None:
        kwargs["forward_micro_batch_size"] = forward_micro
    if optim is not None:
        kwargs.update(lr=optim.lr, min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_steps,
                      lr_decay_steps=lr_decay_steps, lr_decay_style=optim.lr_decay_style,
                      weight_decay=optim.weight_decay,
                      adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps,
                      clip_grad=optim.clip_grad, use_distributed_optimizer=section.use_distributed_optimizer)
    return EngineConfig(**kwargs)


def worker_config(cfg, role: str, total_steps: int | None = None):
    """The :class:`~megaflow.workers.config.MegatronWorkerConfig` of ``role``.

    Batch sizes in the config count prompts (as in verl); the workers count rows, so
    mini-batches are multiplied by ``rollout.n``. ``total_steps`` (training steps of the
    run) sets the trained roles' LR decay horizon (:func:`megaflow.config.lr_schedule_steps`);
    None: ``trainer.total_steps``.

    Raises:
        ConfigError: a decaying LR schedule with no room after warm-up.
    """
    from megaflow.config import lr_schedule_steps
    from megaflow.workers.config import ActorLossConfig, CriticLossConfig, MegatronWorkerConfig

    section, n = getattr(cfg, role), cfg.rollout.n
    model_path, hf_config = cfg.model.path, (dict(cfg.model.hf_config) if cfg.model.hf_config else None)
    if role == "reward_model":
        model_path = section.path
        hf_config = dict(section.hf_config) if section.hf_config else None
    if role == "critic" and section.path:
        model_path = section.path
    if model_path is not None:
        # Recipes write checkpoint paths as ~/...; the workers open them as plain paths.
        model_path, hf_config = os.path.expanduser(model_path), None
    common = dict(model_path=model_path, hf_config=hf_config, tp=section.tp, pp=section.pp, cp=section.cp,
                  vpp=section.vpp, dtype=cfg.model.dtype, seed=cfg.trainer.seed,
                  temperature=cfg.rollout.temperature if cfg.rollout.temperature > 0 else 1.0,
                  sequence_parallel=section.sequence_parallel,
                  **{f: getattr(section, f, False) for f in ("param_offload", "grad_offload", "optimizer_offload")})
    if role in ("actor", "critic"):
        steps = total_steps if total_steps is not None else cfg.trainer.total_steps
        decay = None if steps is None else lr_schedule_steps(cfg, role, steps)
        recompute = section.recompute_granularity
        common.update(recompute_granularity=None if recompute == "none" else recompute,
                      recompute_method=section.recompute_method, recompute_num_layers=section.recompute_num_layers)
    if role == "actor":
        a = cfg.actor
        return MegatronWorkerConfig(
            **common, engine=_engine_config(cfg, "actor", micro=a.ppo_micro_batch_size_per_gpu,
                                            forward_micro=a.log_prob_micro_batch_size_per_gpu, lr_decay_steps=decay),
            ppo_mini_batch_size=a.ppo_mini_batch_size * n, ppo_epochs=a.ppo_epochs, shuffle=a.shuffle,
            actor=ActorLossConfig(policy_loss=a.policy_loss, clip_ratio_low=a.clip_ratio_low,
                                  clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
                                  loss_agg_mode=a.loss_agg_mode, norm_length=cfg.rollout.response_length,
                                  entropy_coeff=a.entropy_coeff, use_kl_loss=cfg.algorithm.use_kl_loss,
                                  kl_loss_coef=cfg.algorithm.kl_loss_coef, kl_loss_type=cfg.algorithm.kl_loss_type))
    if role == "critic":
        c = cfg.critic
        return MegatronWorkerConfig(
            **common, engine=_engine_config(cfg, "critic", micro=c.ppo_micro_batch_size_per_gpu,
                                            forward_micro=c.forward_micro_batch_size_per_gpu, lr_decay_steps=decay),
            ppo_mini_batch_size=c.ppo_mini_batch_size * n, ppo_epochs=c.ppo_epochs,
            critic=CriticLossConfig(cliprange_value=c.cliprange_value, loss_agg_mode=c.loss_agg_mode,
                                    norm_length=cfg.rollout.response_length))
    forward_micro = section.log_prob_micro_batch_size_per_gpu if role == "ref" else section.micro_batch_size_per_gpu
    return MegatronWorkerConfig(**common, engine=_engine_config(cfg, role, micro=None, forward_micro=forward_micro))


def rollout_settings(cfg, tokenizer):
    """The actor's :class:`~megaflow.workers.actor_rollout.RolloutSettings`."""
    from megaflow.workers.actor_rollout import RolloutSettings

    r = cfg.rollout
    eos = tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
    if r.ignore_eos:
        eos_ids = ()  # no stop ids: every response is response_length tokens
    from megaflow.config.memory import cpu_kv_cache_bytes

    kv = None if cfg.resources.use_gpu else cpu_kv_cache_bytes(cfg)
    return RolloutSettings(gen_tp=r.tp, gen_pp=r.pp, response_length=r.response_length,
                           max_prompt_length=cfg.data.max_prompt_length, eos_token_ids=eos_ids,
                           pad_token_id=int(tokenizer.pad_token_id), kv_cache_bytes=kv,
                           gpu_memory_utilization=r.gpu_memory_utilization, seed=cfg.trainer.seed)


def _role_init_args(cfg, role: str, tokenizer, total_steps: int | None):
    from megaflow.single_controller import ClassWithInitArgs

    cls = _import(_ROLE_CLASSES[role])
    if role == "actor":
        return ClassWithInitArgs(cls, worker_config(cfg, role, total_steps), rollout_settings(cfg, tokenizer))
    return ClassWithInitArgs(cls, worker_config(cfg, role, total_steps))


def build_worker_groups(cfg, tokenizer, total_steps: int | None = None) -> WorkerGroups:
    """Create the resource pools and worker groups of every enabled role and initialise
    their models (actor first: its vLLM engines start inside the actor processes).
    ``total_steps``: training steps of the run (the LR decay horizon, see :func:`worker_config`).

    Raises:
        WorkerError: a rank failed to start, naming the role and rank.
    """
    from megaflow.config import enabled_roles
    from megaflow.single_controller import RayWorkerGroup, ResourcePool, create_colocated_worker_cls

    res = cfg.resources
    by_pool: dict[str, list[str]] = {}
    for role in enabled_roles(cfg):
        by_pool.setdefault(getattr(res.placement, role), []).append(role)
    views: dict[str, Any] = {}
    pools = []
    for pool_name, roles in by_pool.items():
        pool = ResourcePool([res.pool_procs_per_node(pool_name)] * res.pool_nodes(pool_name),
                            max_colocate_count=1, use_gpu=bool(res.use_gpu),
                            num_cpus_per_process=res.num_cpus_per_proc, name_prefix=f"megaflow_{pool_name}")
        pools.append(pool)
        members = {role: _role_init_args(cfg, role, tokenizer, total_steps) for role in roles}
        if len(members) == 1:
            (role, init_args), = members.items()
            views[role] = RayWorkerGroup(pool, init_args, name_prefix=role)
        else:
            group = RayWorkerGroup(pool, create_colocated_worker_cls(members), name_prefix=pool_name)
            views.update(group.spawn(prefix_set=set(members)))
    for role in ("actor", "ref", "critic", "reward_model"):
        if role in views:
            views[role].init_model()
    return WorkerGroups(actor=views["actor"], ref=views.get("ref"), critic=views.get("critic"),
                        reward_model=views.get("reward_model"), resource_pools=pools)


def shutdown_worker_groups(groups: WorkerGroups) -> None:
    """Stop every worker process and release the placement groups (idempotent)."""
    for g in (groups.actor, groups.ref, groups.critic, groups.reward_model):
        if g is not None:
            try:
                g.shutdown()
            except Exception:  # noqa: BLE001 - best effort at exit; colocated views share one core
                pass
    for pool in groups.resource_pools:
        pool.remove()
    groups.resource_pools.clear()


__all__ = ["build_worker_groups", "shutdown_worker_groups", "worker_config", "rollout_settings"]
