"""Megatron LoRA adapter <-> HF PEFT adapter (megaflow.models.peft_io) against peft on tiny transformers models.

The reference is independent of peft_io: the adapter is merged by hand in Megatron layout and converted with
megaflow's base-weight conversion (tests/lora_testlib.py); peft loads the exported adapter on top of the base
model and must give the same logits.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
from hf_tiny import hf_logits, tiny_model
from lora_testlib import ALL_TARGETS, merged_hf_state_dict, random_adapter, spec_of

from megaflow.models.hf_mapping import ShardLayout
from megaflow.models.peft_io import (
    AdapterError,
    PeftAdapter,
    megatron_target_modules,
    megatron_to_peft,
    peft_to_megatron,
    read_peft_adapter,
    write_peft_adapter,
)
from megaflow.models.transforms import kv_replication_factor

RANK, ALPHA = 4, 8.0
VARIANTS = ("llama_gqa_untied", "llama_gqa_tied", "qwen2_bias_tied", "qwen3_qknorm_tied")
IDS = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64], [1, 2, 3, 4, 5, 6, 7, 8]])


def _peft_logits(model, adapter_dir) -> torch.Tensor:
    from peft import PeftModel

    peft_model = PeftModel.from_pretrained(copy.deepcopy(model), str(adapter_dir)).eval()
    return hf_logits(peft_model, IDS)


@pytest.mark.parametrize("variant", VARIANTS)
def test_exported_adapter_matches_hand_merged_weights(variant, tmp_path):
    model = tiny_model(variant, num_layers=2)
    adapter = random_adapter(model, RANK, seed=3)
    peft = megatron_to_peft(adapter, spec_of(model), alpha=ALPHA)
    write_peft_adapter(peft, tmp_path / "adapter", base_model="tiny/base")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (RANK, ALPHA, "tiny/base")
    assert sorted(config["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                       "up_proj", "down_proj"])
    merged = copy.deepcopy(model)
    merged.load_state_dict(merged_hf_state_dict(model, adapter, rank=RANK, alpha=ALPHA))
    expected, base = hf_logits(merged, IDS), hf_logits(model, IDS)
    got = _peft_logits(model, tmp_path / "adapter")
    assert (expected - base).abs().max() > 1e-2  # the adapter changes the logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("variant", ["llama_gqa_untied", "qwen3_qknorm_tied"])
def test_round_trip_is_bit_exact(variant, tmp_path):
    model = tiny_model(variant, num_layers=2)
    spec = spec_of(model)
    adapter = random_adapter(model, RANK, seed=4)
    write_peft_adapter(megatron_to_peft(adapter, spec, alpha=ALPHA), tmp_path / "a", base_model="b")
    back = read_peft_adapter(tmp_path / "a")
    assert (back.rank, back.alpha) == (RANK, ALPHA)
    assert megatron_target_modules(back) == sorted(ALL_TARGETS)
    restored = peft_to_megatron(back, spec)
    assert list(restored) == list(adapter)
    for name, tensor in adapter.items():
        assert torch.equal(restored[name], tensor), name


@pytest.mark.parametrize("variant", ["llama_gqa_untied", "llama_mqa"])
def test_tp_pieces_equal_the_full_adapter(variant):
    """TP = 2 pieces built by the import give back the full adapter's PEFT tensors on export (with KV replication
    for the single-KV-head model)."""
    model = tiny_model(variant, num_layers=2)
    spec = spec_of(model)
    full = megatron_to_peft(random_adapter(model, RANK, seed=5), spec, alpha=ALPHA)
    kv_rep = kv_replication_factor(spec.num_key_value_heads, spec.num_attention_heads, 2)
    pieces = [peft_to_megatron(full, spec, ShardLayout(tp_size=2, tp_rank=r, kv_replication=kv_rep))
              for r in range(2)]
    qkv_b = "decoder.layers.0.self_attention.linear_qkv.lora_b.weight"
    proj_a = "decoder.layers.0.self_attention.linear_proj.lora_a.weight"
    assert pieces[0][proj_a].shape[1] == spec.hidden_size // 2
    assert not torch.equal(pieces[0][qkv_b], pieces[1][qkv_b])
    again = megatron_to_peft(pieces, spec, alpha=ALPHA, kv_replication=kv_rep)
    assert again.tensors.keys() == full.tensors.keys()
    for key, tensor in full.tensors.items():
        assert torch.equal(again.tensors[key], tensor), key


def test_peft_trained_adapter_imports(tmp_path):
    """An adapter made by peft itself (q_proj, v_proj only: peft's Llama default) imports, and the Megatron
    adapter merged by hand gives peft's logits (k rows of B are zero)."""
    from peft import LoraConfig, get_peft_model

    model = tiny_model("llama_gqa_untied", num_layers=2)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj",
                                                                                                           "v_proj"]))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name:  # one A per layer, shared by q_proj and v_proj (Megatron's fused qkv has one)
                layer = int(name.split(".layers.")[1].split(".")[0])
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(layer)) * 0.3)
            if "lora_B" in name:  # non-zero (peft initialises B to zero)
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3)
    peft_model.save_pretrained(tmp_path / "p")
    adapter = read_peft_adapter(tmp_path / "p")
    megatron = peft_to_megatron(adapter, spec_of(model))
    merged = copy.deepcopy(model)
    merged.load_state_dict(merged_hf_state_dict(model, megatron, rank=RANK, alpha=ALPHA))
    torch.testing.assert_close(hf_logits(merged, IDS), hf_logits(peft_model.eval(), IDS), rtol=0, atol=1e-5)


def test_import_refuses_differing_a_on_a_fused_module(tmp_path):
    model = tiny_model("llama_gqa_untied", num_layers=2)
    peft = megatron_to_peft(random_adapter(model, RANK, seed=6), spec_of(model), alpha=ALPHA)
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"
    tensors = dict(peft.tensors)
    tensors[key] = tensors[key] + 1e-3
    with pytest.raises(AdapterError, match=r"decoder\.layers\.1\.mlp\.linear_fc1: lora_A of gate_proj and up_proj "
                                           r"differ"):
        peft_to_megatron(PeftAdapter(tensors, RANK, ALPHA, peft.target_modules), spec_of(model))


def test_bad_adapters_are_named(tmp_path):
    model = tiny_model("llama_gqa_untied", num_layers=2)
    spec = spec_of(model)
    adapter = random_adapter(model, RANK, seed=7)
    with pytest.raises(AdapterError, match=r"decoder\.layers\.5\.mlp\.linear_fc2"):
        megatron_to_peft({k.replace("layers.1.mlp.linear_fc2", "layers.5.mlp.linear_fc2"): v
                          for k, v in adapter.items()}, spec, alpha=ALPHA)
    with pytest.raises(AdapterError, match=r"decoder\.layers\.0\.mlp\.linear_fc1 has lora_a but not lora_b"):
        megatron_to_peft({k: v for k, v in adapter.items() if k != "decoder.layers.0.mlp.linear_fc1.lora_b.weight"},
                         spec, alpha=ALPHA)
    wrong = dict(adapter)
    wrong["decoder.layers.0.mlp.linear_fc2.lora_a.weight"] = torch.zeros(RANK, 7)
    with pytest.raises(AdapterError, match=r"decoder\.layers\.0\.mlp\.linear_fc2"):
        megatron_to_peft(wrong, spec, alpha=ALPHA)
    write_peft_adapter(megatron_to_peft(adapter, spec, alpha=ALPHA), tmp_path / "d", base_model="b")
    config = json.loads((tmp_path / "d" / "adapter_config.json").read_text())
    (tmp_path / "d" / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(AdapterError, match="use_dora=True"):
        read_peft_adapter(tmp_path / "d")
