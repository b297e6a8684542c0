"""Parameter counts by formula against real ``transformers`` models (meta device)."""
import pytest

from megaflow.topology.model_spec import (count_parameters, layer_parameters, model_spec, padded_vocab_size,
                                          stage_parameters)

BASE = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 100}
CASES = {
    "llama-untied": {"model_type": "llama", **BASE},
    "llama-tied": {"model_type": "llama", **BASE, "tie_word_embeddings": True},
    "llama-head_dim": {"model_type": "llama", **BASE, "head_dim": 32},
    "llama-mha": {"model_type": "llama", **dict(BASE, num_key_value_heads=4)},
    "qwen2": {"model_type": "qwen2", **BASE},
    "qwen2-tied": {"model_type": "qwen2", **BASE, "tie_word_embeddings": True},
}


@pytest.fixture(scope="module")
def hf_num_parameters():
    import torch
    import transformers

    def count(cfg):
        cfg = dict(cfg)
        config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters())  # parameters() deduplicates tied weights

    return count


@pytest.mark.parametrize("name", CASES)
def test_parameter_count_matches_transformers(name, hf_num_parameters):
    assert count_parameters(model_spec(CASES[name])) == hf_num_parameters(CASES[name])


def test_layer_and_stage_split_by_hand():
    spec = model_spec({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 16})
    # q 64*64, k and v 64*(2*16), o 64*64, gate/up/down 3*64*128: TP-sharded; 2 norms of 64: replicated.
    sharded = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 128
    assert layer_parameters(spec).sharded == sharded == 36864 and layer_parameters(spec).replicated == 128
    # tp=2 pads the vocabulary to 256; each rank holds half of it.
    assert padded_vocab_size(16, 2) == 256 and padded_vocab_size(300, 1) == 384
    per_layer = sharded // 2 + 128
    embedding = 256 * 64 // 2
    assert stage_parameters(spec, tp=2, pp=2) == (2 * per_layer + embedding, 2 * per_layer + 64 + embedding)


@pytest.mark.parametrize("tied", [False, True])
def test_stages_add_up_to_the_model(tied):
    cfg = {"model_type": "llama", **dict(BASE, num_hidden_layers=4, vocab_size=256), "tie_word_embeddings": tied}
    spec = model_spec(cfg)
    assert sum(stage_parameters(spec, tp=1, pp=1)) == count_parameters(spec)
    # with pp > 1 a tied model keeps a second copy of the embedding on the last stage
    extra = 256 * 64 if tied else 0
    assert sum(stage_parameters(spec, tp=1, pp=2)) == count_parameters(spec) + extra
    value = count_parameters(spec, head="value")
    assert value == count_parameters(spec) - (0 if tied else 256 * 64) + 64
