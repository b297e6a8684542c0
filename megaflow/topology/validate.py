"""The checks that span config sections: what a loaded config must satisfy before any
process starts.

Each section of :mod:`megaflow.config.schema` checks its own fields when it is built; the
rules here read several sections at once (the algorithm against the enabled roles, the
parallel sizes against the model and the resource pools, the pools against the cluster's
nodes, batch sizes against DP and micro-batches). A new cross-section rule goes here and
into :func:`validate_config`. :func:`megaflow.topology.load_run` runs it on every config a
run loads. Errors are :class:`~megaflow.config.typed.ConfigError` naming the dotted key
to change.
"""
from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterator
from typing import Any

from megaflow.config.schema import BUILTIN_REWARD_PARTS, GROUP_ESTIMATORS, TASK_DATA_SOURCES, Config
from megaflow.config.typed import ConfigError, check
from megaflow.topology.model_spec import ModelSpec
from megaflow.topology.placement import pack_pools
from megaflow.topology.sizes import (
    TOKEN_BUDGET_KEYS,
    TRAINED_ROLES,
    RoleParallel,
    enabled_roles,
    generation_sizes,
    role_model_spec,
    role_parallel,
    split_rollout_pool,
    token_budgets,
    train_batch_sizes,
)


def _check_pools_fit(cfg: Config) -> None:
    """The pools of ``resources.pools`` fit on the cluster's nodes (first fit, in order).

    Raises:
        ConfigError: at ``resources.pools.<name>...`` (see :func:`~megaflow.topology.placement.pack_pools`).
    """
    try:
        pack_pools(cfg.resources)
    except ConfigError as err:
        raise err.with_prefix("resources") from None


def _check_async_rollout(cfg: Config) -> None:
    if not cfg.trainer.async_rollout:
        return
    check(split_rollout_pool(cfg) is not None, "trainer.async_rollout",
          "one-step-off generation runs on the rollout's own pool: set {0} to a pool other than the actor's",
          "resources.placement.rollout")
    check(cfg.algorithm.adv_estimator != "remax", "trainer.async_rollout",
          "ReMax's greedy baseline would be generated with newer weights than its batch: use another "
          "{0} or turn async_rollout off", "algorithm.adv_estimator")

def _check_roles(cfg: Config) -> None:
    algo = cfg.algorithm
    if algo.adv_estimator == "gae":
        check(cfg.critic.enabled, "critic.enabled", "adv_estimator 'gae' needs a critic: set {0}=true",
              "critic.enabled")
    else:
        check(not cfg.critic.enabled, "critic.enabled",
              f"a critic is only used by adv_estimator 'gae', not {algo.adv_estimator!r}: set it false")
    if algo.uses_ref and cfg.actor.lora.rank == 0:  # with LoRA the actor's frozen base is the reference
        which = "use_kl_in_reward" if algo.use_kl_in_reward else "use_kl_loss"
        check(cfg.ref.enabled, "ref.enabled", f"algorithm.{which}=true needs reference log-probs: set {{0}}=true",
              "ref.enabled")
    check(not algo.filter_groups.enable or algo.adv_estimator in GROUP_ESTIMATORS, "algorithm.filter_groups.enable",
          f"dynamic sampling keeps groups whose rewards vary, which only a group estimator uses: set "
          f"{{0}} to one of {', '.join(GROUP_ESTIMATORS)} (got {algo.adv_estimator!r})", "algorithm.adv_estimator")
    check(not (algo.filter_groups.enable and cfg.trainer.async_rollout), "algorithm.filter_groups.enable",
          "dynamic sampling generates extra rounds inside the step; not available with {0}=true",
          "trainer.async_rollout")
    if algo.adv_estimator in GROUP_ESTIMATORS:
        check(cfg.rollout.n >= 2, "rollout.n",
              f"adv_estimator {algo.adv_estimator!r} compares the samples of a prompt: needs n >= 2, "
              f"got {cfg.rollout.n}")


def _check_filter_metric(cfg: Config) -> None:
    """``algorithm.filter_groups.metric`` (with dynamic sampling on) names a per-sample value
    the run's rewards give (:func:`megaflow.trainer.dynamic_sampling.group_metric` looks it
    up in each scored batch): ``score``, or a part the built-in scorer of one of the run's
    data sources returns (:data:`~megaflow.config.schema.BUILTIN_REWARD_PARTS`), or
    ``format`` with ``reward.format_weight`` > 0 (the format reward adds it to every scorer).
    The run's data sources, as far as they are known at load: the one of ``data.task``;
    with prompt files (read only by the pre-start checks), every built-in one.

    Not checked here (the first step refuses the name, listing the fields of the batch): a
    run where a scorer of ``reward.functions`` may score (that of ``data.task``'s source, or
    any with prompt files), since user code is not imported at load and its parts may
    depend on the response; and a scorer added in-process with
    :func:`megaflow.rewards.register_reward`, which load does not see (give it through
    ``reward.functions``, or filter on ``score``).

    Raises:
        ConfigError: at ``algorithm.filter_groups.metric``, naming the value and the values
            the run's rewards give (with the data sources that give each).
    """
    fg = cfg.algorithm.filter_groups
    if not fg.enable or fg.metric == "score":
        return
    task = cfg.data.task
    sources = [TASK_DATA_SOURCES[task]] if task is not None else [*BUILTIN_REWARD_PARTS, *cfg.reward.functions]
    if any(source in cfg.reward.functions for source in sources):
        return
    given: dict[str, list[str]] = {}
    for source in sources:
        for part in BUILTIN_REWARD_PARTS[source]:
            given.setdefault(part, []).append(source)
    if cfg.reward.format_weight > 0:
        given.setdefault("format", []).append("reward.format_weight > 0")
    close = difflib.get_close_matches(fg.metric, ["score", *given], n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    parts = ", ".join(f"{part!r} ({', '.join(by)})" for part, by in sorted(given.items()))
    inputs = f"{{0}}={task}" if task is not None else "{0}: any built-in data source, the files are read after load"
    check(fg.metric in given, "algorithm.filter_groups.metric",
          f"{fg.metric!r} is no value this run's rewards give{hint}; they give 'score' (the sequence reward) and, by "
          f"data source ({inputs}), {parts}", "data.task" if task is not None else "data.train_files")


#: Feature sections with an on/off switch: (dotted section or key, the switch's dotted key, whether the
#: feature is off). A key under an off feature whose value differs from the schema default is read by
#: nothing, so it is refused (:func:`_check_inert_keys`); the switch itself is not.
INERT_WHEN_OFF: tuple[tuple[str, str, Callable[[Config], bool]], ...] = (
    ("critic", "critic.enabled", lambda cfg: not cfg.critic.enabled),
    ("actor.lora", "actor.lora.rank", lambda cfg: cfg.actor.lora.rank == 0),
    ("critic.lora", "critic.lora.rank", lambda cfg: cfg.critic.lora.rank == 0),
    ("rollout.agent", "rollout.agent.enabled", lambda cfg: not cfg.rollout.agent.enabled),
    ("algorithm.safe_rlhf", "algorithm.safe_rlhf.enable", lambda cfg: not cfg.algorithm.safe_rlhf.enable),
    ("algorithm.filter_groups", "algorithm.filter_groups.enable",
     lambda cfg: not cfg.algorithm.filter_groups.enable),
    ("trainer.max_staleness", "trainer.async_rollout", lambda cfg: not cfg.trainer.async_rollout),
)


def _lookup(obj: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def _shown(value: Any) -> str:
    """A value as a recipe or an override writes it (true/false/null for YAML's words)."""
    if isinstance(value, bool) or value is None:
        return {True: "true", False: "false", None: "null"}[value]
    return repr(value)


def _leaf_keys(section: Any, prefix: str) -> Iterator[str]:
    """The dotted keys of every leaf under ``section`` (a section's fields, recursively)."""
    if not dataclasses.is_dataclass(section):
        yield prefix
        return
    for f in dataclasses.fields(section):
        yield from _leaf_keys(getattr(section, f.name), f"{prefix}.{f.name}")


def _set_by(key: str, overridden: frozenset[str]) -> bool:
    """Whether a command-line override set ``key`` (the key itself, or a section above it given
    as a mapping)."""
    return any(key == o or key.startswith(o + ".") for o in overridden)


def _check_inert_keys(cfg: Config, overridden: frozenset[str]) -> None:
    """A key that a command-line override sets (``overridden``: the overrides' dotted keys) under a
    feature that is off (:data:`INERT_WHEN_OFF`; ``trainer.val_max_samples`` when validation never
    runs) is refused unless it holds the schema default: nothing would read it. Values that come
    from the recipe are not checked, so a switch turned off on the command line (``actor.lora.rank=0``
    on a LoRA recipe, ``trainer.test_freq=0`` on a recipe with ``val_max_samples``) leaves the
    recipe's now unused settings alone, and a checkpoint's config resumes as written.

    Raises:
        ConfigError: at the first such key, naming the switch that turns it off.
    """
    if not overridden:
        return
    defaults = Config()
    for root, switch, off in INERT_WHEN_OFF:
        if not off(cfg):
            continue
        for key in _leaf_keys(_lookup(cfg, root), root):
            value = _lookup(cfg, key)
            check(key == switch or not _set_by(key, overridden) or value == _lookup(defaults, key), key,
                  f"set to {_shown(value)}, but {{0}}={_shown(_lookup(cfg, switch))} turns this off", switch)
    trainer = cfg.trainer
    check(trainer.val_max_samples is None or not _set_by("trainer.val_max_samples", overridden)
          or trainer.test_freq > 0 or trainer.val_before_train,
          "trainer.val_max_samples", f"set to {trainer.val_max_samples}, but {{0}}={trainer.test_freq} and "
          "trainer.val_before_train=false turn validation off", "trainer.test_freq")


def _check_placement(cfg: Config) -> None:
    """Every enabled role names a pool of ``resources.pools``; a disabled role's entry is not read."""
    res = cfg.resources
    for role in enabled_roles(cfg):
        pool = getattr(res.placement, role)
        check(pool in res.pools, f"resources.placement.{role}",
              f"unknown pool {pool!r}; pools: {', '.join(res.pools)}")


def _check_inputs(cfg: Config) -> None:
    check(cfg.model.path is not None or cfg.model.hf_config is not None, "model.path",
          "set {0} (an HF checkpoint directory) or {1} (an inline HF config for a randomly initialised model)",
          "model.path", "model.hf_config")
    check(cfg.model.tokenizer is not None or cfg.model.path is not None, "model.tokenizer",
          "required when {0} is not set (an HF tokenizer directory, or 'arith')", "model.path")
    check(bool(cfg.data.train_files) or cfg.data.task is not None, "data.train_files",
          "no training data: set {0} or {1}", "data.train_files", "data.task")


def _check_model_parallel(spec: ModelSpec, role: str, par: RoleParallel) -> None:
    src = spec.source
    for name, value in (("num_attention_heads", spec.num_attention_heads),
                        ("num_key_value_heads", spec.num_key_value_heads),
                        ("intermediate_size", spec.ffn_hidden_size)):
        check(value % par.tp == 0, f"{role}.tp",
              f"tp={par.tp} must divide the model's {name}={value} ({{0}})", f"{src}")
    stages = par.pp * (par.vpp or 1)
    check(spec.num_layers % stages == 0, f"{role}.pp",
          f"pp={par.pp}" + (f" x vpp={par.vpp}" if par.vpp else "")
          + f" must divide the model's num_hidden_layers={spec.num_layers} ({{0}})", f"{src}")


def _check_expert_parallel(spec: ModelSpec, role: str, par: RoleParallel) -> None:
    """``<role>.ep`` against the model and the mesh: expert parallelism needs experts, and
    ``ep`` must divide the expert count and ``dp * cp`` (megatron-core builds the EP groups out
    of the data-parallel ranks, ``initialize_model_parallel``)."""
    if par.ep == 1:
        return
    check(spec.is_moe, f"{role}.ep", f"ep={par.ep}: expert parallelism needs a mixture-of-experts model, and "
                                     f"{{0}} is a dense {spec.model_type!r} model; use ep=1", spec.source)
    check(spec.num_experts % par.ep == 0, f"{role}.ep",
          f"ep={par.ep} must divide the model's {spec.num_experts} experts ({{0}})", spec.source)
    check((par.dp * par.cp) % par.ep == 0, f"{role}.ep",
          f"ep={par.ep} must divide dp*cp = {par.dp}*{par.cp} of {role}'s pool {par.pool!r} "
          f"({par.world_size} ranks / tp*pp = {par.tp}*{par.pp}): expert ranks are data-parallel ranks")


def _check_expert_parallel_micro_batches(cfg: Config, role: str) -> None:
    """Token-budget micro-batches (``<role>.use_dynamic_bsz``) with ep > 1 are refused: their
    number and shape differ between ranks, and megatron-core's all-gather token dispatcher
    gathers equally many tokens from every EP rank in every forward."""
    section = getattr(cfg, role)
    check(section.ep == 1 or not getattr(section, "use_dynamic_bsz", False), f"{role}.use_dynamic_bsz",
          f"token-budget micro-batches differ in number and shape between ranks, and with {{0}}={section.ep} "
          "megatron-core's all-gather token dispatcher needs equally many tokens from every EP rank: set it false",
          f"{role}.ep")


def _check_moe_on_cpu(cfg: Config, spec: ModelSpec, role: str, par: RoleParallel) -> None:
    """Mixture-of-experts models on CPU run at tp = 1 only: megatron-core's ``MoELayer.forward``
    refuses training with tp > 1 unless sequence parallelism is on (``moe/moe_layer.py``), and
    sequence parallelism needs Transformer Engine, hence CUDA (the same rule as
    :func:`megaflow.megatron.moe.check_moe_supported`, here before any process starts)."""
    check(cfg.resources.use_gpu or not spec.is_moe or par.tp == 1, f"{role}.tp",
          f"tp={par.tp} with a mixture-of-experts model ({{0}}: {spec.num_experts} experts) needs sequence "
          "parallelism (megatron-core's MoELayer refuses tp > 1 in training without it), which needs CUDA: use "
          f"tp=1 and expert parallelism ({role}.ep) on CPU", spec.source)


def _check_router_aux_losses(cfg: Config, spec: ModelSpec, role: str) -> None:
    """``actor.moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` above 0 need a mixture-of-experts
    model, tp = 1 (with tp > 1 megatron-core's MoE layers run sequence parallel, so a rank's
    router sees part of each sequence and the sequence-wise losses would need a TP reduction
    megaflow does not do) and no full recomputation (the losses are attached in the forward,
    which a recomputed layer runs again outside the micro-batch it belongs to)."""
    section = getattr(cfg, role)
    for key in ("moe_aux_loss_coeff", "moe_z_loss_coeff"):
        if not getattr(section, key, 0.0):
            continue
        check(spec.is_moe, f"{role}.{key}", f"a router loss needs a mixture-of-experts model, and {{0}} is a dense "
                                            f"{spec.model_type!r} model; set it to 0", spec.source)
        check(section.tp == 1, f"{role}.{key}", "needs {0}=1 (the router losses are per sequence, and at tp > 1 "
                                                "the MoE layers split sequences over TP ranks); set it to 0 or tp=1",
              f"{role}.tp")
        check(section.recompute_granularity != "full", f"{role}.{key}",
              "cannot be combined with {0}='full' (a recomputed layer would attach the router losses again); "
              "use 'selective' or 'none', or set it to 0", f"{role}.recompute_granularity")


def _check_router_replay(cfg: Config, spec: ModelSpec) -> None:
    """``actor.router_replay`` other than off needs a mixture-of-experts actor and no full
    recomputation (a recomputed layer would route again without the replayed experts). R3 needs
    single-turn rollouts: the agent loop (``rollout.agent.enabled``) is refused whatever the
    model, since its observation tokens are appended to the response without an engine forward,
    so the engine has no routing of them to replay. R2 needs the old-log-prob forward it records
    at (no ``actor.on_policy_old_log_probs``, no ``algorithm.rollout_correction.bypass``)."""
    if cfg.actor.router_replay == "off":
        return
    check(cfg.actor.router_replay != "R3" or not cfg.rollout.agent.enabled, "actor.router_replay",
          "R3 cannot be combined with {0}=true: the agent loop's observation tokens are not routed by the "
          "engine, so there is no routing to replay; use R2 (the trainer's own routing) or off, or set {0}=false",
          "rollout.agent.enabled")
    check(spec.is_moe, "actor.router_replay", f"replays expert routing, and {{0}} is a dense {spec.model_type!r} "
                                              "model; use off", spec.source)
    check(cfg.actor.recompute_granularity != "full", "actor.router_replay",
          "cannot be combined with {0}='full' (a recomputed layer routes again, without the replayed experts)",
          "actor.recompute_granularity")
    if cfg.actor.router_replay == "R2":  # R2 records at the old-log-prob forward: it must run
        check(not cfg.actor.on_policy_old_log_probs, "actor.router_replay",
              "R2 records the routing at the old-log-prob forward, which {0}=true skips; use R3 or off",
              "actor.on_policy_old_log_probs")
        check(not cfg.algorithm.rollout_correction.bypass, "actor.router_replay",
              "R2 records the routing at the old-log-prob forward, which {0}=true skips (old log-probs = the "
              "rollout's); use R3 or off", "algorithm.rollout_correction.bypass")


def _check_lora(cfg: Config) -> None:
    """``<role>.lora`` (actor, critic) against the model and the features LoRA cannot take yet.

    rank at most the smaller size of every targeted linear; no mixture-of-experts model (the
    experts' linears get no adapters); no sequence parallelism (megaflow.megatron.lora); the
    actor's ``sync`` adapter only with the colocated engine (:func:`_check_adapter_sync`); with the actor's LoRA
    the reference log-probs come from the actor with adapters disabled, so ``ref.enabled`` is
    false.

    Raises:
        ConfigError: naming the key to change.
    """
    from megaflow.topology.lora import lora_layer_dims

    for role in ("actor", "critic"):
        lora = getattr(cfg, role).lora
        if lora.rank == 0 or role not in enabled_roles(cfg):
            continue
        spec = role_model_spec(cfg, role)
        check(not spec.is_moe, f"{role}.lora.rank", f"LoRA on a mixture-of-experts model ({spec.model_type}) is not "
                                                    f"supported: the experts get no adapters; set it 0", spec.source)
        dims = lora_layer_dims(spec)
        for target in lora.target_modules:
            size = min(dims[target])
            check(lora.rank <= size, f"{role}.lora.rank",
                  f"{lora.rank} exceeds {target}'s smaller dimension {size} (in, out = {dims[target]}): a rank above "
                  "it adds parameters but no expressiveness")
        check(not getattr(cfg, role).sequence_parallel, f"{role}.sequence_parallel",
              "LoRA adapters do not support sequence parallelism yet: set it false or {0}=0", f"{role}.lora.rank")
    if cfg.actor.lora.rank == 0:
        return
    _check_adapter_sync(cfg)
    check(not cfg.ref.enabled, "ref.enabled",
          "must be false with {0} > 0: the reference log-probs come from the actor with its adapters disabled "
          "(the frozen base is the initial policy), no reference group is needed", "actor.lora.rank")


def _check_adapter_sync(cfg: Config) -> None:
    """``actor.lora.sync='adapter'`` only with the colocated, synchronous engine: the adapter
    route writes the adapters to a run-private directory of the actor's processes and reloads
    them in the engine of the same process; split placement (``resources.placement.rollout``)
    and one-step-off generation (``trainer.async_rollout``, which needs split placement) send
    the merged weights to another pool's engines instead.

    Raises:
        ConfigError: at ``actor.lora.sync``, naming the key that asks for the other pool.
    """
    if cfg.actor.lora.sync == "merged":
        return
    for key, wanted in (("trainer.async_rollout", cfg.trainer.async_rollout),
                        ("resources.placement.rollout", split_rollout_pool(cfg) is not None)):
        check(not wanted, "actor.lora.sync",
              "'adapter' (the engine loading the adapters alone) needs the colocated engine in the actor's "
              "processes, which {0} takes away: use 'merged'", key)


def _check_colocated_meshes(cfg: Config) -> None:
    """Roles on one pool share one process per rank, hence Megatron's one (process-global)
    parallel state: their tp, pp, cp, ep and vpp must be equal."""
    first: dict[str, str] = {}
    for role in enabled_roles(cfg):
        pool = getattr(cfg.resources.placement, role)
        other = first.setdefault(pool, role)
        for name in ("tp", "pp", "cp", "ep", "vpp"):
            mine, theirs = getattr(getattr(cfg, role), name), getattr(getattr(cfg, other), name)
            check(mine == theirs, f"{role}.{name}",
                  f"{name}={mine} differs from {{0}}={theirs}; roles colocated on pool {pool!r} share one "
                  f"process per rank and one Megatron mesh: use the same {name}, or place {role} on its own "
                  f"pool (resources.placement.{role})", f"{other}.{name}")


def validate_config(cfg: Config, overridden: frozenset[str] = frozenset()) -> None:
    """Checks across sections, run by :func:`megaflow.topology.load_run` on every loaded config
    (``overridden``: the dotted keys its command-line overrides set).

    The pools fit on the cluster's nodes; inputs set (model, tokenizer, training data); algorithm vs enabled roles;
    no key set on the command line under a feature that is off, away from its schema default
    (:func:`_check_inert_keys`);
    every enabled role placed on a known pool; for every enabled role: world size = tp*pp*cp*dp on its pool, tp dividing
    the heads, KV heads and FFN size, pp (x vpp) dividing the layers; the rollout's t_g | t and p_g | p (hence
    t_g dividing the heads too); ep > 1 only for a mixture-of-experts model, dividing its experts and
    dp*cp; a mixture-of-experts model at tp = 1 on CPU; LoRA (``<role>.lora``) within the model's layer sizes and
    without the features it cannot take yet; roles colocated on one pool with equal tp/pp/cp/vpp;
    batch sizes divisible by mini-batches, DP and micro-batches.

    Raises:
        ConfigError: the first violated rule, with the dotted key to change.
    """
    _check_pools_fit(cfg)
    _check_inputs(cfg)
    _check_roles(cfg)
    _check_filter_metric(cfg)
    _check_inert_keys(cfg, overridden)
    _check_placement(cfg)
    _check_lora(cfg)  # before the mixture-of-experts refusal: LoRA's own reason comes first
    for role in enabled_roles(cfg):
        _check_expert_parallel(role_model_spec(cfg, role), role, role_parallel(cfg, role))
        _check_moe_on_cpu(cfg, role_model_spec(cfg, role), role, role_parallel(cfg, role))
        _check_expert_parallel_micro_batches(cfg, role)
        _check_model_parallel(role_model_spec(cfg, role), role, role_parallel(cfg, role))
        check(cfg.resources.use_gpu or not getattr(cfg, role).sequence_parallel, f"{role}.sequence_parallel",
              "not available on CPU (megatron-core's local layer spec refuses it); set it false or {0}=true",
              "resources.use_gpu")
    for role in TOKEN_BUDGET_KEYS:
        if role in enabled_roles(cfg):
            token_budgets(cfg, role)
    _check_router_aux_losses(cfg, role_model_spec(cfg, "actor"), "actor")
    _check_router_replay(cfg, role_model_spec(cfg, "actor"))
    _check_colocated_meshes(cfg)
    generation_sizes(cfg)  # t_g | t and p_g | p; with t | heads this gives t_g | heads
    _check_async_rollout(cfg)
    for role in TRAINED_ROLES:
        if role in enabled_roles(cfg):
            train_batch_sizes(cfg, role)
    if cfg.actor.on_policy_old_log_probs:
        _check_on_policy_update(cfg)
    check(not cfg.algorithm.rollout_correction.bypass_loss or cfg.actor.policy_loss == "ppo",
          "actor.policy_loss", "must be ppo when {0} makes the actor's loss the bypass loss (weights, rs or "
          "reinforce with bypass=true)", "algorithm.rollout_correction.bypass")


def _check_on_policy_update(cfg: Config) -> None:
    """``actor.on_policy_old_log_probs`` needs an update that is on-policy by construction
    (one epoch, one mini-batch of the whole step) and no stage that reads the old log-probs
    before the update.

    Raises:
        ConfigError: at the key that breaks it.
    """
    key, actor, algo = "actor.on_policy_old_log_probs", cfg.actor, cfg.algorithm
    check(actor.ppo_epochs == 1, "actor.ppo_epochs",
          f"must be 1 with {{0}}=true (a second epoch sees updated weights), got {actor.ppo_epochs}", key)
    check(actor.ppo_mini_batch_size == cfg.data.train_batch_size, "actor.ppo_mini_batch_size",
          f"must equal data.train_batch_size={cfg.data.train_batch_size} with {{0}}=true (one mini-batch, "
          f"so no optimizer step comes before a later mini-batch's forward), got {actor.ppo_mini_batch_size}", key)
    check(not algo.use_kl_in_reward, "algorithm.use_kl_in_reward",
          "must be false with {0}=true (the reward's KL reads the old log-probs before the update)", key)
    rc = algo.rollout_correction
    for sub in ("is_level", "rejection"):
        check(getattr(rc, sub) == "none", f"algorithm.rollout_correction.{sub}",
              "must be none with {0}=true (it reads the old log-probs before the update)", key)
    check(rc.rs is None, "algorithm.rollout_correction.rs",
          "must be null with {0}=true (it reads the old log-probs before the update)", key)
    check(rc.max_mismatch is None, "algorithm.rollout_correction.max_mismatch",
          "must be null with {0}=true (it reads the old log-probs before the update)", key)
    check(not rc.bypass, "algorithm.rollout_correction.bypass",
          "excludes {0}=true: choose one source of the old log-probs", key)
    check(not cfg.trainer.async_rollout, "trainer.async_rollout",
          "must be false with {0}=true (one step off corrects with importance weights from the old log-probs)", key)


__all__ = ["validate_config"]
