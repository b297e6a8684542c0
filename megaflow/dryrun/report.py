"""``format_plan``: the dry run's human-readable report of a :class:`~megaflow.dryrun.plan.Plan`."""
from __future__ import annotations

from megaflow.dryrun.memory import CONTROLLER_BYTES, GIB, RAY_NODE_BYTES
from megaflow.dryrun.plan import Plan, PoolPlan, RolePlan, RolloutPlan, SplitRolloutPlan
from megaflow.topology.placement import Groups


def _span(ranks: tuple[int, ...]) -> str:
    """``(0,1,2,3)`` -> ``0-3``; ``(0,8)`` -> ``0,8``."""
    if len(ranks) > 2 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _groups(name: str, groups: Groups, max_groups: int) -> str:
    shown = " ".join(f"[{_span(g)}]" for g in groups[:max_groups])
    more = f" ... ({len(groups) - max_groups} more)" if len(groups) > max_groups else ""
    return f"    {name} ({len(groups)} of {len(groups[0])} ranks): {shown}{more}"


def _gib(num_bytes: float) -> str:
    """Bytes in the largest binary unit that keeps the value >= 1 (GiB at most)."""
    for unit, size in (("GiB", GIB), ("MiB", 1024 ** 2), ("KiB", 1024)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}" if num_bytes >= 10 * size else f"{num_bytes / size:.2f} {unit}"
    return f"{num_bytes:.0f} B"


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def _header(plan: Plan) -> list[str]:
    m, req = plan.model, plan.requirements
    device = "GPUs" if plan.use_gpu else "CPU processes"
    memory = f", {_gib(plan.device_memory)} per {'GPU' if plan.use_gpu else 'node'}" if plan.device_memory else ""
    return [
        f"megaflow dry run: {plan.experiment}",
        f"model    {m.model_type}, {_count(plan.num_parameters)} parameters ({m.source}): {m.num_layers} layers, "
        f"hidden {m.hidden_size}, {m.num_attention_heads} heads / {m.num_key_value_heads} KV heads "
        f"(head_dim {m.head_dim}), FFN {m.ffn_hidden_size}, vocab {m.vocab_size}"
        f"{', tied embeddings' if m.tie_word_embeddings else ''}; {plan.dtype}",
        f"cluster  {plan.cluster_nodes} node(s) x {plan.cluster_procs_per_node} {device}{memory}; "
        f"the run needs {req.nodes} node(s) with {req.procs_per_node} ranks, {req.gpus_per_node} GPUs "
        f"and {req.cpus_per_node} CPUs each",
        f"step     {plan.num_samples} samples (prompts x rollout.n), up to {plan.max_seq_len} tokens each",
    ]


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 'es' if word.endswith('ss') else 's'}"


def _pool_lines(pool: PoolPlan, split: bool, use_gpu: bool) -> list[str]:
    p = pool.placement
    roles = ["actor+rollout" if r == "actor" and not split else r for r in pool.roles]
    share = "colocated, one process per rank" if len(roles) > 1 else "own processes"
    where = f"node {p.nodes[0]}" if len(p.nodes) == 1 else f"nodes {_span(p.nodes)}"
    each = _plural(p.procs_per_node, "GPU" if use_gpu else "process") + ("" if len(p.nodes) == 1 else " each")
    return [f"  {p.name}: {where}, {each} = {_plural(p.world_size, 'rank')}; roles {', '.join(roles)} ({share})"]


def _role_lines(rp: RolePlan, max_groups: int) -> list[str]:
    par, mem = rp.parallel, rp.memory
    lines = [f"{rp.role} (pool {par.pool}, {par.world_size} ranks): tp={par.tp} pp={par.pp} cp={par.cp} dp={par.dp}"
             + (f" vpp={par.vpp}" if par.vpp else "")
             + (f" ep={par.ep} (expert dp={par.dp * par.cp // par.ep})" if rp.model.is_moe else "")
             + ("   [megatron order tp-cp-ep-dp-pp]" if rp.model.is_moe else "   [megatron order tp-cp-dp-pp]")]
    lines.append(_groups("tp groups", rp.groups.tp_groups, max_groups))
    if par.cp > 1:
        lines.append(_groups("cp groups", rp.groups.cp_groups, max_groups))
    lines.append(_groups("dp groups", rp.groups.dp_groups, max_groups))
    lines.append(_groups("pp groups", rp.groups.pp_groups, max_groups))
    if rp.batch is not None:
        b = rp.batch
        lines.append(f"    update: {b.num_mini_batches} mini-batch(es) of {b.mini_batch_size} samples "
                     f"({b.mini_batch_size_per_dp_rank} per dp rank = {b.num_micro_batches} micro-batch(es) of "
                     f"{b.micro_batch_size}); {b.num_optimizer_steps} optimizer step(s) per training step")
        lines.append("    optimizer: " + (f"distributed (state sharded over dp={par.dp * par.cp})"
                                          if rp.distributed_optimizer else "plain (state not sharded over dp)"))
    lines.append(f"    forward micro-batch: {rp.forward_micro_batch} samples per rank")
    offload = [k for k, on in (("params", mem.param_offload), ("grads", mem.grad_offload),
                               ("optimizer", mem.optimizer_offload)) if on]
    experts = f" (experts {_gib(mem.expert_params)})" if rp.model.is_moe else ""
    lines.append(f"    memory per rank: params {_gib(mem.params)}{experts}, grads {_gib(mem.grads)}, optimizer "
                 f"{_gib(mem.optimizer)}, activations {_gib(mem.activations)} -> peak {_gib(mem.peak)}"
                 + (f"; offloaded between phases: {', '.join(offload)}" if offload else ""))
    return lines


def _split_lines(sp: SplitRolloutPlan) -> list[str]:
    routes = "; ".join(f"tp rank {g.gen_tp_rank}: actor rank {g.source} -> rollout ranks {list(g.receivers)}"
                       for g in sp.transport.groups)
    return [f"    weight sync (broadcast, actor generation replica 0 -> rollout pool): {routes}",
            f"    each sync moves {_gib(sp.bytes_per_rank)} to every rollout rank, {_gib(sp.bytes_total)} in all"]


def _rollout_lines(ro: RolloutPlan, max_groups: int) -> list[str]:
    s, lay, mem, cost = ro.sizes, ro.layout, ro.memory, ro.reshard
    where = "in the actor's processes" if ro.split is None else \
        f"own pool {ro.split.pool}, {ro.split.world_size} ranks; the actor reshards, then broadcasts"
    return [
        f"rollout ({where}): t_g={s.tp} p_g={s.pp}, micro-DP d_g={s.micro_dp}; "
        f"{s.num_replicas} generation replicas of {s.tp * s.pp} rank(s), {s.samples_per_replica} samples each",
        *([] if ro.split is None else _split_lines(ro.split)),
        _groups("generation tp groups", lay.gen_tp_groups, max_groups),
        _groups("micro-dp groups", lay.micro_dp_groups, max_groups),
        f"    reshard train->generate per rank: receives {_gib(cost.micro_dp_bytes)} "
        f"(naive full gather: {_gib(cost.naive_bytes)}); generation shard {_gib(mem.weights)}, "
        f"of which all-gathered {_gib(mem.extra_weights)}",
        f"    KV cache per rank: {_gib(mem.kv_per_sequence)} per sequence, {_gib(mem.kv_needed)} for all its "
        f"samples at full length; reserved {_gib(mem.kv_reserved)}",
    ]


def _memory_lines(plan: Plan) -> list[str]:
    limit = plan.device_memory if plan.use_gpu else None  # (set whenever use_gpu)
    lines = [f"memory per rank by phase{'' if limit is None else ' (limit ' + _gib(limit) + ' per GPU)'}:"]
    for pool in plan.pools:
        lines.append(f"  pool {pool.placement.name}:")
        for phase in pool.phases:
            parts = ", ".join(f"{name} {_gib(b)}" for name, b in phase.parts if b > 0)
            over = plan.use_gpu and plan.device_memory is not None and phase.total > plan.device_memory
            lines.append(f"    {phase.phase:<22} {_gib(phase.total):>10}{'  DOES NOT FIT' if over else ''}  ({parts})")
        lines += _gpu_pool_lines(pool)
    return lines + _host_lines(plan) + _cpu_node_lines(plan)


def _gpu_pool_lines(pool: PoolPlan) -> list[str]:
    """GPU plans: what the runtime headroom counts and the host copies of one rank."""
    lines = []
    if pool.communicators:
        lines.append(f"    runtime headroom counts {len(pool.communicators)} NCCL communicator(s): "
                     f"{', '.join(pool.communicators)}")
    if pool.host is not None and pool.host.parts:
        lines.append("    host copies per rank: " + ", ".join(f"{n} {_gib(b)}" for n, b in pool.host.parts))
    return lines


def _host_lines(plan: Plan) -> list[str]:
    """GPU plans: host copies per node, pinned and pageable."""
    same: dict[tuple[float, float], list[int]] = {}
    for node, pinned, pageable in plan.host_per_node:
        same.setdefault((pinned, pageable), []).append(node)
    return (["host memory per node (copies kept between phases):"] if same else []) + [
        f"  node{'s' if len(nodes) > 1 else ''} {_span(tuple(nodes))}: {_gib(pinned + pageable)} each "
        f"({_gib(pinned)} pinned, {_gib(pageable)} pageable)" for (pinned, pageable), nodes in same.items()]


def _cpu_node_lines(plan: Plan) -> list[str]:
    """CPU plans: every process of a node together (ranks, Ray's processes, the controller)."""
    limit = f" (limit {_gib(plan.device_memory)})" if plan.device_memory else ""
    return ([f"memory per node{limit}, every process: the ranks' peak phases + Ray's processes "
             f"{_gib(RAY_NODE_BYTES)} (+ the controller {_gib(CONTROLLER_BYTES)} on node 0):"]
            if plan.node_memory else []) + [f"  node {node}: {_gib(total)}" for node, total in plan.node_memory]


def format_plan(plan: Plan, max_groups: int = 4) -> str:
    """The plan as text: model and cluster, pools, per-role groups and batch split, the
    generation layout, memory per phase, then problems (or that the layout fits) and notes.

    Args:
        plan: from :func:`megaflow.dryrun.build_plan`.
        max_groups: groups printed per kind before "... (N more)".
    """
    lines = _header(plan) + ["pools"]
    for pool in plan.pools:
        lines += _pool_lines(pool, split=plan.rollout.split is not None, use_gpu=plan.use_gpu)
    for rp in plan.roles:
        lines += [""] + _role_lines(rp, max_groups)
    lines += [""] + _rollout_lines(plan.rollout, max_groups) + [""] + _memory_lines(plan) + [""]
    if plan.problems:
        lines.append(f"PROBLEMS ({len(plan.problems)}): this layout cannot run")
        lines += [f"  - {p}" for p in plan.problems]
    else:
        lines.append("fits: every phase is within the device memory")
    lines += [f"warning: {w}" for w in plan.warnings]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
