"""The weight sync's peak formula (megaflow.topology.weight_sync) and the planner's "weight sync" phase.

Expected values are worked out by hand from the model's shapes (issue 31: llama70b_ppo, t=8 -> t_g=4, bf16).
"""
import pytest

from megaflow.topology.weight_sync import largest_generation_tensor_bytes, weight_sync_peak_bytes

GIB, MIB = 2 ** 30, 2 ** 20


def test_peak_is_actor_plus_engine_plus_one_bucket_plus_the_largest_tensor():
    assert weight_sync_peak_bytes(actor_shard=10, engine_weights=100, bucket_bytes=20, largest_tensor=5) == 135
    # a tensor larger than the bucket forms a bucket of its own
    assert weight_sync_peak_bytes(actor_shard=10, engine_weights=100, bucket_bytes=20, largest_tensor=30) == 170
    # a bucket never holds more than the engine's weights
    assert weight_sync_peak_bytes(actor_shard=10, engine_weights=100, bucket_bytes=1000, largest_tensor=5) == 215
    with pytest.raises(ValueError, match="bucket_bytes=0"):
        weight_sync_peak_bytes(actor_shard=1, engine_weights=1, bucket_bytes=0, largest_tensor=1)


def _llama70b_spec():
    from megaflow.dryrun import build_plan
    from megaflow.topology import load_run

    plan = build_plan(load_run("llama70b_ppo", []))
    return plan, plan.role("actor").model


def test_largest_tensor_of_the_70b_generation_shard_is_the_padded_vocabulary():
    _, spec = _llama70b_spec()
    assert (spec.vocab_size, spec.hidden_size, spec.ffn_hidden_size) == (128256, 8192, 28672)
    # Megatron pads 128256 to a multiple of 128 * 8 = 129024 rows; t_g = 4: 32256 rows x 8192 x 2 bytes
    vocab = 129024 // 4 * 8192 * 2
    fc1 = 2 * 28672 // 4 * 8192 * 2
    assert vocab > fc1
    assert largest_generation_tensor_bytes(spec, train_tp=8, gen_tp=4, dtype_bytes=2) == vocab == 504 * MIB
    # t = t_g = 1: 128256 is a multiple of 128 and of 64, both sides hold the real rows
    assert largest_generation_tensor_bytes(spec, train_tp=1, gen_tp=1, dtype_bytes=2) == 128256 * 8192 * 2


def test_the_70b_plan_has_a_weight_sync_phase_with_the_formula():
    plan, spec = _llama70b_spec()
    pool = next(p for p in plan.pools if "actor" in p.roles)
    phases = {p.phase: p for p in pool.phases}
    sync = phases["weight sync"]
    parts = dict(sync.parts)
    actor = plan.role("actor").memory
    engine = plan.rollout.memory.weights
    assert parts["actor params"] == actor.params
    assert parts["rollout engine weights"] == engine
    assert parts["weight-sync bucket"] == 512 * MIB  # rollout.weight_sync_bucket_mb of the recipe
    assert parts["largest generation tensor"] == 504 * MIB
    tensors = sync.total - parts["runtime headroom"]  # the GPU run's CUDA context, NCCL and fragmentation
    assert tensors == pytest.approx(actor.params + engine + 512 * MIB + 504 * MIB + actor.resident - actor.params)
    # far below the gather-first route: actor + gathered + engine (+ vocabulary gather + bucket)
    assert tensors < actor.params + 2 * engine
    assert 37 * GIB < tensors < 39 * GIB


def test_largest_tensor_of_an_moe_generation_shard_is_one_layers_expert_stacks():
    """Qwen3-30B-A3B at t_g = 1: a layer's fused w13 + w2 stacks (128 experts) plus one expert's fc1 being
    converted outweigh the vocabulary; the dense intermediate_size (6144, unused by sparse layers) does not count."""
    from megaflow.topology.model_spec import ModelSpec

    spec = ModelSpec.from_hf_config({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                                     "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                                     "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                                     "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                                     "moe_intermediate_size": 768, "norm_topk_prob": True,
                                     "tie_word_embeddings": False})
    stacks = (3 * 128 * 768 + 2 * 768) * 2048 * 2  # w13 [128, 1536, 2048] + w2 [128, 2048, 768] + one fc1
    assert stacks > 151936 * 2048 * 2
    assert largest_generation_tensor_bytes(spec, train_tp=1, gen_tp=1, dtype_bytes=2) == stacks
    # t_g = 2 halves each expert's width
    assert largest_generation_tensor_bytes(spec, train_tp=2, gen_tp=2, dtype_bytes=2) == stacks // 2
