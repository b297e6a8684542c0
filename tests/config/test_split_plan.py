"""The dry-run plan of split placement: the rollout's own pool, the broadcast routes and the
bytes each weight sync moves (counted here from the recipe's architecture)."""
from __future__ import annotations

from megaflow.dryrun import build_plan
from megaflow.dryrun.memory import CPU_WORKER_RUNTIME_BYTES

from megaflow.dryrun.report import format_plan
from megaflow.topology import load_run

SPLIT = ["resources.procs_per_node=6", "resources.pools={actor: {procs_per_node: 2}, gen: {procs_per_node: 4}}",
         "resources.placement.actor=actor", "resources.placement.ref=actor", "resources.placement.critic=actor",
         "resources.placement.reward_model=actor", "resources.placement.rollout=gen", "rollout.tp=2"]


def _tiny_parameters() -> int:
    """tiny_arith_grpo's model: hidden 128, FFN 384, 2 layers, 4 heads / 2 KV heads, vocab 16, untied."""
    hidden, ffn, layers, vocab, head_dim = 128, 384, 2, 16, 32
    attention = hidden * (4 + 2 * 2) * head_dim + 4 * head_dim * hidden
    mlp = 3 * hidden * ffn
    return layers * (attention + mlp + 2 * hidden) + 2 * vocab * hidden + hidden


def test_split_plan_shows_the_rollout_pool_routes_and_sync_bytes():
    plan = build_plan(load_run("tiny_arith_grpo", SPLIT))
    split = plan.rollout.split
    assert (split.pool, split.world_size) == ("gen", 4)
    assert plan.rollout.sizes.num_replicas == 2  # 4 rollout ranks at t_g = 2
    # t=2 -> t_g=2: actor ranks 0 and 1 hold shards 0 and 1; rollout ranks r % 2 == j receive shard j
    assert [(g.gen_tp_rank, g.source, g.receivers) for g in split.transport.groups] == [(0, 0, (0, 2)), (1, 1, (1, 3))]
    model_bytes = 4 * _tiny_parameters()  # fp32
    assert split.bytes_per_rank == model_bytes // 2 and split.bytes_total == 4 * (model_bytes // 2)
    pools = {p.placement.name: p for p in plan.pools}
    assert pools["gen"].roles == ("rollout",) and pools["actor"].roles == ("actor",)
    # the engines' pool holds the generation shard, the KV cache and (CPU) a worker's runtime; the actor's no KV cache
    gen_phase = pools["gen"].phases[0]
    assert gen_phase.total == plan.rollout.memory.weights + plan.rollout.memory.kv_reserved + CPU_WORKER_RUNTIME_BYTES
    assert dict(pools["actor"].phases[0].parts)["rollout KV cache"] == 0.0
    text = format_plan(plan)
    assert "gen: node 0, 4 processes = 4 ranks; roles rollout (own processes)" in text
    assert "actor rank 0 -> rollout ranks [0, 2]; tp rank 1: actor rank 1 -> rollout ranks [1, 3]" in text
    assert "actor+rollout" not in text


def test_colocated_plan_has_no_split():
    plan = build_plan(load_run("tiny_arith_grpo", []))
    assert plan.rollout.split is None
    assert "roles actor+rollout" in format_plan(plan)
