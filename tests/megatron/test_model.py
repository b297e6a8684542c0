"""Model builder: HF config mapping, validation errors, and built models vs transformers."""
from __future__ import annotations

import pytest
import torch

from megaflow.megatron import model as M
from megaflow.topology.model_spec import model_spec
from megaflow.utils.launch import run_distributed
from megatron_testlib import (VOCAB, hf_causal_lm, hf_to_megatron_shard, load_shard,
                              tiny_llama_config, tiny_qwen2_config)


# ---------------------------------------------------------------- config mapping (no processes)

def test_llama_config_maps_gqa_swiglu_rmsnorm():
    cfg = tiny_llama_config(rms_norm_eps=1e-5, head_dim=32)
    tc = M.transformer_config_from_hf(cfg)
    assert (tc.num_layers, tc.hidden_size, tc.ffn_hidden_size) == (4, 64, 96)
    assert (tc.num_attention_heads, tc.num_query_groups, tc.kv_channels) == (4, 2, 32)
    assert tc.normalization == "RMSNorm" and tc.layernorm_epsilon == 1e-5
    assert tc.gated_linear_unit and tc.activation_func is torch.nn.functional.silu
    assert not tc.add_bias_linear and not tc.add_qkv_bias
    assert tc.params_dtype == torch.float32 and not tc.bf16
    assert tc.use_cpu_initialization == (not torch.cuda.is_available())
    assert not tc.gradient_accumulation_fusion and not tc.sequence_parallel


def test_qwen2_from_config_json_dict_has_qkv_bias_and_tied_embeddings():
    cfg = tiny_qwen2_config().to_dict()
    arch = model_spec(cfg)
    assert arch.qkv_bias and arch.tie_word_embeddings
    assert M.transformer_config_from_hf(cfg, dtype=torch.bfloat16).add_qkv_bias
    assert M.transformer_config_from_hf(cfg, dtype=torch.bfloat16).bf16


def test_rope_base_and_scaling():
    # transformers v4 config.json style and v5 rope_parameters style
    v4 = dict(tiny_llama_config().to_dict(), rope_theta=500000.0,
              rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    v4.pop("rope_parameters")
    arch = model_spec(v4)
    assert (arch.rope_theta, arch.rope_scaling_factor) == (500000.0, 8.0)
    linear = dict(tiny_llama_config().to_dict(),
                  rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    assert model_spec(linear).rope_interpolation_factor == 2.0
    assert model_spec(tiny_llama_config(rope_theta=12345.0)).rope_theta == 12345.0


@pytest.mark.parametrize("change, field", [
    (dict(model_type="mixtral"), "model_type"),
    (dict(num_local_experts=8), "num_local_experts"),
    (dict(use_sliding_window=True, sliding_window=128), "use_sliding_window"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(attention_bias=True), "attention_bias"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope_parameters.rope_type"),
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                           "rope_theta": 1e4}), "rope_parameters.low_freq_factor"),
])
def test_unsupported_features_name_the_field(change, field):
    cfg = dict(tiny_llama_config().to_dict(), **change)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        M.transformer_config_from_hf(cfg)


def test_bad_types_and_missing_fields():
    with pytest.raises(TypeError, match="PretrainedConfig"):
        model_spec(["not", "a", "config"])
    cfg = dict(tiny_llama_config().to_dict(), hidden_size=None)
    with pytest.raises(ValueError, match=r"^hf_config\.hidden_size: missing"):
        model_spec(cfg)


def test_tp_must_divide_heads_and_kv_heads():
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        M.transformer_config_from_hf(tiny_llama_config(), tensor_model_parallel_size=3)
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        M.transformer_config_from_hf(tiny_llama_config(), tensor_model_parallel_size=4)
    with pytest.raises(ValueError, match="not divisible by pp"):
        M.transformer_config_from_hf(tiny_llama_config(num_hidden_layers=3),
                                     pipeline_model_parallel_size=2)


@pytest.mark.parametrize("vocab, tp, expected", [(200, 1, 256), (200, 2, 256), (257, 2, 512),
                                                 (49152, 3, 49152), (151643, 4, 152064), (128, 1, 128)])
def test_padded_vocab_size(vocab, tp, expected):
    assert M.padded_vocab_size(vocab, tp) == expected
    assert expected % (128 * tp) == 0 and expected - vocab < 128 * tp


def test_padded_vocab_size_rejects_non_positive():
    with pytest.raises(ValueError):
        M.padded_vocab_size(0, 1)


# ---------------------------------------------------------------- built models (processes)

def _gather_vocab(logits, tp_group):
    import torch.distributed as dist

    parts = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(parts, logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def _build_and_run(rank, world, tp):
    from megaflow.megatron import parallel

    info = parallel.initialize_parallel(tp=tp, seed=3)
    results = {}
    ids = torch.randint(0, VOCAB, (3, 12), generator=torch.Generator().manual_seed(1))
    causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)[None, None]
    pos = torch.arange(12)[None].expand(3, -1)
    for name, cfg in (("llama", tiny_llama_config()), ("qwen2", tiny_qwen2_config())):
        hf = hf_causal_lm(cfg, seed=7)
        model = M.build_gpt_model(cfg)
        load_shard(model, hf_to_megatron_shard(hf.state_dict(), cfg, tp_rank=info.tp_rank, tp=tp,
                                               pp_rank=0, pp=1))
        with torch.no_grad():
            logits = _gather_vocab(model(ids, pos, causal), info.tp_group)
            ref = hf(input_ids=ids).logits
        results[name] = (logits[..., :VOCAB] - ref).abs().max().item()
    critic = M.build_gpt_model(tiny_llama_config(), head="value")
    head = critic.output_layer.weight
    results["critic_head"] = (tuple(head.shape), head.tensor_model_parallel, float(head.sum()))
    with torch.no_grad():
        results["critic_out_shape"] = tuple(critic(ids, pos, causal).shape)
    errors = {}
    for key, fn in {
        "kv_heads": lambda: M.build_gpt_model(tiny_llama_config(num_key_value_heads=1)),
        "world": lambda: parallel.initialize_parallel(tp=tp, pp=2),
        "head": lambda: M.build_gpt_model(tiny_llama_config(), head="policy"),
    }.items():
        try:
            fn()
            errors[key] = None
        except (ValueError, RuntimeError) as e:
            errors[key] = f"{type(e).__name__}: {e}"
    results["errors"] = errors
    parallel.destroy_parallel()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_built_model_matches_transformers(tp):
    results = run_distributed(_build_and_run, tp, tp, timeout_s=600)
    for r in results:
        assert r["llama"] < 1e-4 and r["qwen2"] < 1e-4, r
        assert r["critic_head"][:2] == ((1, 64), False)
        assert r["critic_out_shape"] == (3, 12, 1)
    # the replicated scalar head is identical on every TP rank
    assert len({r["critic_head"][2] for r in results}) == 1
    errors = results[0]["errors"]
    if tp == 2:
        assert "ValueError" in errors["kv_heads"] and "num_key_value_heads=1" in errors["kv_heads"]
    assert "ValueError" in errors["world"] and "not divisible by tp*pp*cp" in errors["world"]
    assert "ValueError" in errors["head"] and "policy" in errors["head"]
