"""The dry-run planner: rank groups, pool layout, memory formulas, infeasible layouts."""
import pytest

from megaflow.dryrun import PlanError, build_plan, format_plan

from megaflow.topology import load_run, run_from_dict
from megaflow.topology.placement import megatron_groups, pack_pools
from megaflow.dryrun.memory import (
    GIB,
    ParallelShape,
    activation_bytes_per_layer,
    kv_bytes_per_token,
    role_memory,
)
from megaflow.config.schema import ResourcesConfig
from megaflow.topology.model_spec import model_spec

SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 16}


def test_megatron_groups_hand_example():
    # megatron-core's parallel_state docstring example order: tp fastest, then dp, then pp.
    g = megatron_groups(tp=2, pp=2, dp=2)
    assert g.tp_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert g.dp_groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert g.pp_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    g = megatron_groups(tp=2, pp=1, dp=1, cp=2)
    assert g.tp_groups == ((0, 1), (2, 3)) and g.cp_groups == ((0, 2), (1, 3))


def test_megatron_groups_partition_a_large_world():
    tp, cp, dp, pp = 4, 2, 3, 2
    g = megatron_groups(tp=tp, pp=pp, dp=dp, cp=cp)
    for groups, size in ((g.tp_groups, tp), (g.cp_groups, cp), (g.dp_groups, dp), (g.pp_groups, pp)):
        assert all(len(group) == size for group in groups)
        assert sorted(r for group in groups for r in group) == list(range(tp * cp * dp * pp))
    # a rank's coordinates: tp_rank = r % tp, cp = (r // tp) % cp, dp = (r // (tp*cp)) % dp, pp = r // (tp*cp*dp)
    for group in g.pp_groups:
        assert len({r % (tp * cp * dp) for r in group}) == 1


def test_pools_first_fit_on_nodes():
    res = ResourcesConfig(use_gpu=False, nodes=2, procs_per_node=4,
                          pools={"a": {"nodes": 1}, "b": {"nodes": 1, "procs_per_node": 2},
                                 "c": {"nodes": 1, "procs_per_node": 2}},
                          placement={"actor": "a", "ref": "a", "critic": "a", "reward_model": "a"})
    placed = pack_pools(res)
    assert placed["a"].nodes == (0,) and placed["b"].nodes == (1,) and placed["c"].nodes == (1,)
    assert placed["c"].world_size == 2 and placed["a"].node_of(3) == 0


def test_activation_formula_by_hand():
    # The saved-tensor account of megaflow.dryrun.memory (elements per token): norms 2*(3h+1),
    # attention 4*a*d/t + a*s/t (unfused), MLP 5f/t; plus RoPE tables 4*s*d and the s*s mask.
    s, b, h, a, g, d, f, t = 24, 4, 64, 4, 2, 16, 128, 2
    common = dict(seq=s, micro_batch=b, hidden=h, heads=a, kv_heads=g, head_dim=d, ffn_hidden=f, tp=t)
    expected = 4 * s * b * (2 * (3 * h + 1) + (4 * a * d + a * s) / t + 5 * f / t) + 4 * 4 * s * d + s * s
    got = activation_bytes_per_layer(**common, sequence_parallel=False, recompute="none", fused_attention=False,
                                     dtype="float32")
    assert got == pytest.approx(expected)
    sp_selective = activation_bytes_per_layer(**common, sequence_parallel=True, recompute="selective",
                                              fused_attention=False, dtype="bfloat16")
    assert sp_selective == pytest.approx(2 * s * b * (2 * (3 * h + 1) / t + (3 * a * d + 3 * g * d) / t + 5 * f / t)
                                         + 2 * 4 * s * d + s * s)
    full = activation_bytes_per_layer(**common, sequence_parallel=False, recompute="full", fused_attention=False,
                                      dtype="bfloat16")
    assert full == pytest.approx(2 * s * b * h)
    with pytest.raises(ValueError, match="recompute"):
        activation_bytes_per_layer(**common, sequence_parallel=False, recompute="some", fused_attention=False,
                                   dtype="float32")


def test_role_memory_by_hand():
    spec = model_spec(SMALL)
    shape = ParallelShape(tp=2, pp=2, cp=1, dp=2, vpp=None, sequence_parallel=False, recompute="none",
                          micro_batch=4, num_micro_batches=4, seq=24)
    mem = role_memory("actor", spec, shape, dtype="float32", trained=True, distributed_optimizer=True,
                      fused_attention=False, head="lm")
    last_stage = 2 * (36864 // 2 + 128) + 64 + 256 * 64 // 2  # 2 layers, final norm, half the padded lm_head
    assert mem.params == last_stage * 4
    assert mem.grads == last_stage * 4  # fp32 main grads
    assert mem.optimizer == last_stage * 8 / 2  # two fp32 Adam moments, sharded over dp=2
    s, b, h, d = 24, 4, 64, 16  # SMALL: 4 heads, 2 KV heads, ffn 128
    per_layer = 4 * s * b * (2 * (3 * h + 1) + (4 * 4 * d + 4 * s) / 2 + 5 * 128 / 2) + 4 * 4 * s * d + s * s
    first = 2 * 2 * per_layer  # 1F1B: min(pp, micro-batches)=2 in flight x 2 layers
    # + the final norm (3h + 1 per token) and fp32 logits and their gradient
    last = 2 * per_layer + 4 * s * b * (3 * h + 1) + 2 * 4 * s * b * 256 / 2
    assert mem.activations == pytest.approx(max(first, last))
    bf16 = role_memory("actor", spec, shape, dtype="bfloat16", trained=True, distributed_optimizer=False,
                       fused_attention=False, head="lm")
    assert bf16.optimizer == last_stage * 12  # fp32 master + 2 moments, not sharded


def test_kv_cache_formula_by_hand():
    spec = model_spec(SMALL)  # 4 layers, 2 KV heads, head_dim 16
    assert kv_bytes_per_token(spec, gen_tp=1, gen_pp=1, dtype="float32") == 2 * 4 * 2 * 16 * 4
    assert kv_bytes_per_token(spec, gen_tp=2, gen_pp=2, dtype="bfloat16") == 2 * 2 * 1 * 16 * 2


def test_plan_uses_the_hybridflow_generation_layout(tiny):
    hf = dict(SMALL, num_attention_heads=8, num_key_value_heads=4)
    cfg = run_from_dict(tiny(model={"hf_config": hf, "tokenizer": "arith"}, actor={"tp": 4, "pp": 2},
                             rollout={"tp": 2}, resources={"use_gpu": False, "procs_per_node": 16}))
    plan = build_plan(cfg)
    layout = plan.rollout.layout
    # t=4, p=2, d=2, t_g=2: generation TP groups at stride t/t_g=2 inside a TP block;
    # micro-DP groups of d_g=4: consecutive ranks of the block, extended across both stages.
    assert (0, 2) in layout.gen_tp_groups and (1, 3) in layout.gen_tp_groups
    assert (0, 1, 8, 9) in layout.micro_dp_groups and len(layout.micro_dp_groups[0]) == 4
    assert plan.role("actor").groups.pp_groups[0] == (0, 8)
    text = format_plan(plan)
    assert "micro-DP d_g=4; 8 generation replicas of 2 rank(s)" in text


def test_impossible_memory_is_flagged_and_rejected():
    # Llama-3-70B at tp=8 pp=1 with nothing offloaded: ~17.6 GB of bf16 weights, twice that
    # in fp32 grads and the optimizer state per GPU cannot fit 80 GiB.
    overrides = [f"{role}.{k}={v}" for role in ("actor", "critic") for k, v in
                 (("pp", 1), ("param_offload", "false"), ("grad_offload", "false"), ("optimizer_offload", "false"))]
    overrides += ["ref.pp=1", "reward_model.pp=1"]
    plan = build_plan(load_run("llama70b_ppo", overrides))
    assert not plan.fits
    assert any("actor update" in p and "per GPU > resources.gpu_memory_gib=80" in p for p in plan.problems)
    assert "DOES NOT FIT" in format_plan(plan) and "PROBLEMS" in format_plan(plan)
    with pytest.raises(PlanError, match="the layout cannot run") as err:
        plan.raise_if_infeasible()
    assert isinstance(err.value, ValueError)


def test_kv_cache_too_small_for_one_sequence_on_cpu():
    plan = build_plan(load_run("smollm2_gsm8k_grpo", ["resources.use_gpu=false", "rollout.response_length=80000"]))
    assert any(p.startswith("rollout.cpu_kv_cache_gib: the rollout's KV cache") for p in plan.problems)


def test_host_memory_per_node_on_cpu():
    plan = build_plan(load_run("tiny_arith_grpo", ["resources.cpu_memory_gib=1"]))
    # 2 processes each reserving rollout.cpu_kv_cache_gib=1 GiB exceed 1 GiB per node
    assert any(p.startswith("node 0: ") and "resources.cpu_memory_gib=1" in p for p in plan.problems)
    assert build_plan(load_run("tiny_arith_grpo")).fits


def test_colocated_phase_adds_what_other_roles_keep_resident():
    plan = build_plan(load_run("llama3_8b_ppo"))
    pool = plan.pools[0]
    critic_update = next(p for p in pool.phases if p.phase == "critic update")
    actor, critic = plan.role("actor").memory, plan.role("critic").memory
    ref, rm = plan.role("ref").memory, plan.role("reward_model").memory
    # actor offloads only its optimizer; ref and reward model offload their params
    tensors = critic_update.total - dict(critic_update.parts)["runtime headroom"]
    assert tensors == pytest.approx(critic.peak + actor.params + actor.grads)
    assert ref.resident == 0 and rm.resident == 0
    assert plan.requirements.gpus_per_node == 8
    assert max(p.total for p in pool.phases) < 80 * GIB


@pytest.mark.parametrize("procs, chosen, expected", [
    (2, None, "plain (state not sharded over dp)"),        # tp=2 -> dp=1: null means plain
    (4, None, "distributed (state sharded over dp=2)"),   # tp=2 -> dp=2: null means distributed
    (4, False, "plain (state not sharded over dp)"),       # an explicit choice wins over dp
])
def test_plan_states_whether_the_optimizer_is_distributed(tiny, procs, chosen, expected):
    cfg = run_from_dict(tiny(model={"hf_config": SMALL, "tokenizer": "arith"},
                             actor={"tp": 2, "use_distributed_optimizer": chosen},
                             resources={"use_gpu": False, "procs_per_node": procs}))
    plan = build_plan(cfg)
    assert plan.role("actor").distributed_optimizer is (expected.startswith("distributed"))
    actor_block = format_plan(plan).split("\nactor ", 1)[1].split("\n    memory per rank", 1)[0]
    assert f"    optimizer: {expected}" in actor_block


def test_moe_cluster_recipe_plans_expert_parallelism_and_its_memory():
    """qwen3_30b_a3b_grpo: the dry run shows EP next to TP/PP/DP, the experts each rank holds
    (E/ep of every layer, sharded over TP) and the weight-sync phase."""
    from megaflow.topology.model_spec import layer_parameters

    cfg = load_run("qwen3_30b_a3b_grpo", [])
    plan = build_plan(cfg)
    actor = plan.role("actor")
    spec = actor.model
    assert (actor.parallel.tp, actor.parallel.pp, actor.parallel.dp, actor.parallel.ep) == (4, 1, 4, 4)
    assert actor.memory.expert_params == 48 * layer_parameters(spec).experts // (4 * 4) * 2  # bf16
    text = format_plan(plan)
    assert "tp=4 pp=1 cp=1 dp=4 ep=4 (expert dp=1)" in text and "[megatron order tp-cp-ep-dp-pp]" in text
    assert "(experts 3.38 GiB)" in text and "weight sync" in text and plan.fits
