"""The planner's memory model against an exact account of a real megatron-core actor
(one rank, via tools/bench_memory.py's measurement) and against hand counts."""
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from toolslib import load_tool  # noqa: E402

from megaflow.dryrun.memory import rollout_memory  # noqa: E402
from megaflow.topology.model_spec import model_spec  # noqa: E402

SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 16}


def test_generation_shard_keeps_the_training_vocab_padding_by_hand():
    spec = model_spec(SMALL)
    # t=2 pads the vocab to 256 rows, t_g=1 would pad to 128: the gathered shard has 256 rows
    layer = 64 * (4 + 2 * 2) * 16 + 4 * 16 * 64 + 3 * 64 * 128 + 2 * 64
    full = 4 * layer + 256 * 64 * 2 + 64  # embedding + untied output (256 rows each) + final norm
    train = 4 * (layer - 2 * 64) // 2 + 4 * 2 * 64 + 128 * 64 * 2 + 64
    mem = rollout_memory(spec, train_tp=2, train_pp=1, gen_tp=1, gen_pp=1, dtype="float32", seq=8,
                         samples_per_replica=1, engine_budget=None, cpu_kv_cache=1.0)
    assert mem.weights == full * 4 and mem.extra_weights == (full - train) * 4
    aliased_nothing = rollout_memory(spec, train_tp=2, train_pp=1, gen_tp=1, gen_pp=1, dtype="float32", seq=8,
                                     samples_per_replica=1, engine_budget=None, cpu_kv_cache=1.0,
                                     params_in_buffer=True)
    assert aliased_nothing.extra_weights == full * 4


@pytest.mark.slow
def test_planner_matches_the_exact_account_of_one_rank():
    bench = load_tool("bench_memory")
    for case in (bench.Case("one-rank-none", world=1), bench.Case("one-rank-selective", world=1,
                                                                  recompute="selective")):
        plan, meas = bench.planned(case), bench.measured(case, timeout_s=300)
        for term in ("params", "grads", "optimizer", "gen_weights", "gen_extra", "kv_cache"):
            assert plan[term] == pytest.approx(meas[term], rel=0.05, abs=1), (case.name, term)
        assert plan["layer_activations"] == pytest.approx(meas["layer_activations"], rel=0.25), case.name
        assert meas["params"] > 0 and meas["optimizer"] == pytest.approx(2 * meas["params"], rel=1e-3)


MOE = {"model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
       "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 16, "num_local_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "architectures": ["Qwen3MoeForCausalLM"]}


def test_expert_parameters_and_their_optimizer_state_per_ep_rank_by_hand():
    from megaflow.dryrun.memory import ParallelShape, moe_dispatch_bytes, moe_layer_activation_bytes, role_memory

    spec = model_spec(MOE)
    experts_per_rank = 4 * (4 * 3 * 64 * 32) // 2  # 4 layers, 4 experts of 3*h*f_e, half on each of ep=2 ranks
    shape = ParallelShape(tp=1, pp=1, cp=1, dp=2, vpp=None, sequence_parallel=False, recompute="none",
                          micro_batch=2, num_micro_batches=1, seq=8, ep=2)
    mem = role_memory("actor", spec, shape, dtype="float32", trained=True, distributed_optimizer=True,
                      fused_attention=False, head="lm")
    dense_shape = ParallelShape(**{**shape.__dict__, "ep": 1})
    whole = role_memory("actor", spec, dense_shape, dtype="float32", trained=True, distributed_optimizer=True,
                        fused_attention=False, head="lm")
    assert mem.expert_params == experts_per_rank * 4
    assert whole.params - mem.params == experts_per_rank * 4  # ep=1 holds the other half as well
    dense = mem.params / 4 - experts_per_rank
    # Adam's 8 bytes: dense state over dp=2, the experts' over expert-dp = dp/ep = 1
    assert mem.optimizer == (dense / 2 + experts_per_rank) * 8
    assert (mem.expert_grads, mem.expert_optimizer) == (experts_per_rank * 4, experts_per_rank * 8)
    assert whole.expert_optimizer == 2 * experts_per_rank * 8 / 2  # ep=1: all experts, sharded over dp=2
    # one EP rank, 16 tokens. Router + all-gather dispatch per token: its fp32 input (h), top-k int64 ids +
    # fp32 probs (12k), fp32 logits + scores (8E), 2 fp32 aux-loss terms, the int64 permutation index of its
    # k rows (8k), the local bool routing map + fp32 probs of the gathered tokens over E/ep experts (5E bytes).
    # Experts per routed row (k per token): the permuted fp32 input (h), SwiGLU 6*f_e, the fp32 probability.
    rows = 16
    dispatch = rows * (4 * 64 + 12 * 2 + 8 * 4 + 8 + 8 * 2 + 5 * 4)
    assert moe_dispatch_bytes(spec, seq=8, micro_batch=2, ep=2, dtype="float32") == dispatch
    assert moe_dispatch_bytes(spec, seq=8, micro_batch=2, ep=1, dtype="float32") == dispatch  # nothing grows with ep
    assert moe_layer_activation_bytes(spec, seq=8, micro_batch=2, ep=2, dtype="float32") == (
        dispatch + 2 * rows * (4 * (64 + 6 * 32) + 4))


def test_generation_shard_gathers_the_other_ep_ranks_experts_by_hand():
    spec = model_spec(MOE)
    experts = 4 * (4 * 3 * 64 * 32)  # every expert of the 4 layers
    kwargs = dict(train_tp=1, train_pp=1, gen_tp=1, gen_pp=1, dtype="float32", seq=8, samples_per_replica=1,
                  engine_budget=None, cpu_kv_cache=1.0)
    same = rollout_memory(spec, **kwargs)
    split = rollout_memory(spec, **kwargs, train_ep=2)
    assert same.extra_weights == 0  # t_g = t, ep = 1: the generation shard is the training shard
    assert split.weights == same.weights and split.extra_weights == experts // 2 * 4  # the other rank's half
