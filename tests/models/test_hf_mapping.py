"""Pure checks of the HF <-> megatron-core mapping table and its transforms (no processes)."""
from __future__ import annotations

import pytest
import torch

from hf_tiny import VARIANTS, tiny_config, tiny_model
from megaflow.models import transforms as T
from megaflow.models.hf_mapping import (PARAM_MAPPINGS, ModelSpec, ShardLayout,
                                        UnsupportedModelError, expected_hf_keys, find_mapping,
                                        hf_names, hf_order, hf_shape, hf_to_megatron_shard,
                                        megatron_shards_to_hf)


def _spec(model_type, layers, hidden, heads, kv_heads, head_dim, ffn, vocab):
    """A spec read from an HF config dict (untied, causal LM)."""
    return ModelSpec.from_hf_config({
        "model_type": model_type, "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": ffn, "vocab_size": vocab})


def _labelled(num_heads: int, head_dim: int, tag: float, hidden: int = 3) -> torch.Tensor:
    """Rows of head j are all ``tag + j`` (so a layout can be read off the row values)."""
    heads = torch.arange(num_heads, dtype=torch.float32) + tag
    return heads.repeat_interleave(head_dim)[:, None].expand(-1, hidden).clone()


def test_fused_qkv_follows_megatron_group_layout_written_by_hand():
    # 4 query heads, 2 KV groups: group g = [q(2g), q(2g+1), k(g), v(g)]
    q, k, v = _labelled(4, 2, 0.0), _labelled(2, 2, 100.0), _labelled(2, 2, 200.0)
    fused = T.fuse_qkv(q, k, v, num_heads=4, num_kv_heads=2, head_dim=2)
    row_labels = fused[::2, 0].tolist()
    assert row_labels == [0, 1, 100, 200, 2, 3, 101, 201]


def test_megatron_shard_to_vllm_layout_written_by_hand():
    q, k, v = _labelled(4, 2, 0.0), _labelled(2, 2, 100.0), _labelled(2, 2, 200.0)
    fused = T.fuse_qkv(q, k, v, num_heads=4, num_kv_heads=2, head_dim=2)
    shard1 = T.shard_tp(fused, 0, 2, 1)  # TP rank 1 holds KV group 1
    vllm = T.megatron_qkv_to_vllm(shard1, num_heads=2, num_kv_heads=1, head_dim=2)
    assert vllm[::2, 0].tolist() == [2, 3, 101, 201]  # all local q, then k, then v
    shard = T.fuse_qkv(_labelled(4, 2, 0.0), _labelled(2, 2, 100.0), _labelled(2, 2, 200.0),
                       num_heads=4, num_kv_heads=2, head_dim=2)
    vllm_full = T.megatron_qkv_to_vllm(shard, num_heads=4, num_kv_heads=2, head_dim=2)
    assert vllm_full[::2, 0].tolist() == [0, 1, 2, 3, 100, 101, 200, 201]
    assert torch.equal(T.vllm_qkv_to_megatron(vllm_full, num_heads=4, num_kv_heads=2,
                                              head_dim=2), shard)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (8, 4), (8, 2), (8, 1)])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_qkv_split_fuse_shard_gather_unfuse_is_bit_exact(num_heads, num_kv_heads, tp, with_bias):
    head_dim, hidden = 4, 16
    spec = _spec("qwen2", 1, hidden, num_heads, num_kv_heads, head_dim, 8, 10)
    g = torch.Generator().manual_seed(tp * 100 + num_kv_heads)
    tail = () if with_bias else (hidden,)
    q = torch.randn(num_heads * head_dim, *tail, generator=g)
    k = torch.randn(num_kv_heads * head_dim, *tail, generator=g)
    v = torch.randn(num_kv_heads * head_dim, *tail, generator=g)
    # split -> fuse of a global tensor is the identity
    fused = T.fuse_qkv(q, k, v, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    for a, b in zip(T.split_qkv(fused, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                head_dim=head_dim), (q, k, v)):
        assert torch.equal(a, b)
    rep = T.kv_replication_factor(num_kv_heads, num_heads, tp)
    row = next(r for r in PARAM_MAPPINGS if r.transform == "qkv" and (r.requires == "qkv_bias") == with_bias)
    shards = [hf_to_megatron_shard(row, [q, k, v], spec, ShardLayout(tp, r, kv_replication=rep))
              for r in range(tp)]
    assert all(s.shape[0] == (num_heads + 2 * num_kv_heads * rep) * head_dim // tp for s in shards)
    if rep == 1:  # shards of the fused tensor == contiguous chunks of the global fused tensor
        assert torch.equal(torch.cat(shards), fused)
    back = megatron_shards_to_hf(row, shards, spec, kv_replication=rep)
    for a, b in zip(back, (q, k, v)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_split_fuse_shard_gather_unfuse_is_bit_exact(tp):
    spec = _spec("llama", 1, 16, 4, 4, 4, 24, 10)
    g = torch.Generator().manual_seed(tp)
    gate, up = torch.randn(24, 16, generator=g), torch.randn(24, 16, generator=g)
    row = next(r for r in PARAM_MAPPINGS if r.transform == "gate_up")
    shards = [hf_to_megatron_shard(row, [gate, up], spec, ShardLayout(tp, r)) for r in range(tp)]
    for r, shard in enumerate(shards):  # each rank: its gate chunk, then its up chunk
        assert torch.equal(shard[:24 // tp], gate[r * 24 // tp:(r + 1) * 24 // tp])
        assert torch.equal(shard[24 // tp:], up[r * 24 // tp:(r + 1) * 24 // tp])
    g2, u2 = megatron_shards_to_hf(row, shards, spec)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    assert all(torch.equal(a, b) for a, b in zip(T.split_gate_up(T.fuse_gate_up(gate, up)), (gate, up)))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_row_round_trips_with_vocab_padding(tp):
    spec = _spec("qwen2", 2, 16, 4, 2, 4, 24, 10)
    padded = 16 * tp  # rows 10..padded-1 are padding
    rep = T.kv_replication_factor(spec.num_key_value_heads, spec.num_attention_heads, tp)
    g = torch.Generator().manual_seed(tp)
    for row, layer in hf_order(spec):
        names = hf_names(row, spec, layer)
        full = [torch.randn(hf_shape(n, spec), generator=g) for n in names]
        shards = [hf_to_megatron_shard(row, full, spec, ShardLayout(tp, r, padded, rep))
                  for r in range(tp)]
        if row.transform == "vocab":
            gathered = torch.cat(shards)
            assert gathered.shape[0] == padded and not gathered[10:].any()  # zero padding rows
        if row.tp_dim == 1:
            assert all(s.shape[1] == full[0].shape[1] // tp for s in shards)
        back = megatron_shards_to_hf(row, shards, spec, kv_replication=rep)
        assert all(torch.equal(a, b) for a, b in zip(back, full)), names
    with pytest.raises(ValueError, match="tp=4 does not divide"):
        qkv = next(r for r in PARAM_MAPPINGS if r.transform == "qkv")
        hf_to_megatron_shard(qkv, [torch.zeros(16, 16), torch.zeros(8, 16), torch.zeros(8, 16)],
                             spec, ShardLayout(4, 0))


def test_kv_replication_rules():
    assert T.kv_replication_factor(2, 8, 2) == 1
    assert T.kv_replication_factor(2, 8, 4) == 2
    assert T.kv_replication_factor(1, 4, 4) == 4
    with pytest.raises(ValueError, match="num_key_value_heads=6 and tp=4"):
        T.kv_replication_factor(6, 12, 4)
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible"):
        T.kv_replication_factor(3, 9, 2)
    k = torch.randn(2 * 3, 5)
    rep = T.replicate_kv_heads(k, num_kv_heads=2, head_dim=3, factor=2)
    assert torch.equal(rep[:3], k[:3]) and torch.equal(rep[3:6], k[:3]) and torch.equal(rep[6:9], k[3:])
    drifted = rep.clone()
    drifted[3:6] += 1.0  # replicas trained apart are averaged on export
    assert torch.allclose(T.deduplicate_kv_heads(drifted, num_kv_heads=2, head_dim=3, factor=2)[:3],
                          k[:3] + 0.5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_table_names_and_shapes_equal_a_real_transformers_model(variant):
    model = tiny_model(variant)
    spec = ModelSpec.from_hf_config(model.config)
    # save_pretrained drops the tied lm_head: compare with the keys it writes
    saved = {k: tuple(v.shape) for k, v in model.state_dict().items()
             if not (spec.tie_word_embeddings and k == "lm_head.weight")}
    assert sorted(expected_hf_keys(spec)) == sorted(saved)
    assert all(hf_shape(k, spec) == shape for k, shape in saved.items())


def test_megatron_names_of_local_and_transformer_engine_specs_resolve():
    spec = ModelSpec.from_hf_config(tiny_config("qwen2_bias_untied"))
    for name, hf in [
        ("decoder.layers.3.input_layernorm.weight", ("model.layers.7.input_layernorm.weight",)),
        ("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight",
         ("model.layers.7.input_layernorm.weight",)),
        ("decoder.layers.3.mlp.linear_fc1.layer_norm_weight",
         ("model.layers.7.post_attention_layernorm.weight",)),
        ("decoder.layers.3.self_attention.linear_qkv.bias",
         tuple(f"model.layers.7.self_attn.{p}_proj.bias" for p in "qkv")),
        ("output_layer.weight", ("lm_head.weight",)),
    ]:
        row, local = find_mapping(name, spec)
        assert hf_names(row, spec, None if local is None else local + 4) == hf
    tied = ModelSpec.from_hf_config(tiny_config("llama_gqa_tied"))
    row, _ = find_mapping("output_layer.weight", tied)
    assert hf_names(row, tied) == ("model.embed_tokens.weight",)
    assert "lm_head.weight" not in expected_hf_keys(tied)
    with pytest.raises(KeyError, match="linear_qkv.bias"):
        find_mapping("decoder.layers.0.self_attention.linear_qkv.bias", tied)  # llama: no bias


@pytest.mark.parametrize("field,value,match", [
    ("architectures", ["MistralForCausalLM"], r"^hf_config\.architectures: \['MistralForCausalLM'\]"),
    ("model_type", "gpt2", r"^hf_config\.architectures: .*\(model_type='gpt2'\) is not supported"),
    ("num_local_experts", 8, "num_local_experts"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}, "rope_type"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_unsupported_architectures_and_features_name_the_field(field, value, match):
    cfg = tiny_config("llama_gqa_untied").to_dict()
    cfg[field] = value
    with pytest.raises(ValueError, match=match):
        ModelSpec.from_hf_config(cfg)


def test_unknown_architecture_is_an_unsupported_model_error():
    cfg = tiny_config("llama_gqa_untied").to_dict()
    cfg["architectures"] = ["LlamaForTokenClassification"]
    with pytest.raises(UnsupportedModelError, match="LlamaForTokenClassification"):
        ModelSpec.from_hf_config(cfg)
