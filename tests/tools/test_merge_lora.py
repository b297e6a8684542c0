"""tools/merge_lora.py against peft's own ``merge_and_unload`` on a tiny Llama with a peft-made adapter."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from toolslib import load_tool

RANK, ALPHA = 4, 16


def _tiny_llama(path, tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).float().eval()
    model.save_pretrained(path, safe_serialization=True)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 32}))
    return model


def _peft_adapter(model, path):
    """A peft adapter on every linear of the layers with random (non-zero) A and B, saved to ``path``."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                  "down_proj"]))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    peft_model.save_pretrained(path)
    return peft_model


@pytest.mark.parametrize("tied", [False, True])
def test_merge_equals_peft_merge_and_unload(tmp_path, tied):
    from safetensors.torch import load_file

    model = _tiny_llama(tmp_path / "base", tied)
    peft_model = _peft_adapter(model, tmp_path / "adapter")
    expected = peft_model.merge_and_unload().state_dict()
    rc = load_tool("merge_lora").main(["--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"),
                                       "--out", str(tmp_path / "merged")])
    assert rc == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert (tmp_path / "merged" / "tokenizer_config.json").is_file()
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] == tied
    changed = 0
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
        changed += not torch.equal(tensor, model.state_dict()[name])
    assert changed == 2 * 7  # every adapted linear of both layers, nothing else


def test_adapter_that_does_not_fit_is_refused(tmp_path, capsys):
    model = _tiny_llama(tmp_path / "base", False)
    _peft_adapter(model, tmp_path / "adapter")
    from safetensors.torch import load_file, save_file

    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    tensors[key] = torch.zeros(RANK, 7)
    save_file(tensors, str(weights))
    capsys.readouterr()  # the fixtures' progress bars
    rc = load_tool("merge_lora").main(["--base", str(tmp_path / "base"), "--adapter", str(tmp_path / "adapter"),
                                       "--out", str(tmp_path / "merged")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: PEFT adapter module model.layers.1.mlp.down_proj"), err
    assert not (tmp_path / "merged").exists()
