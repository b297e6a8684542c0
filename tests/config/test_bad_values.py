"""Values refused at load that the README's bad-input table shows once: the forms around each edge."""
import math

import pytest

from megaflow.config.typed import ConfigError, split_host_port
from megaflow.rewards.manager import RewardFunctionError, score_one
from megaflow.topology.model_spec import model_spec

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 16, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("address, expected", [
    ("10.0.0.1:6379", ("10.0.0.1", 6379)), ("head:1", ("head", 1)), ("[::1]:6379", ("::1", 6379)),
    ("head", None), ("head:0", None), ("head:65536", None), (":6379", None), ("::1:6379", None),
    ("head: 80", None), ("head:x", None), ("a b:80", None),
])
def test_split_host_port(address, expected):
    assert split_host_port(address) == expected


@pytest.mark.parametrize("fields", [{"eos_token_id": [0, 15]}, {"eos_token_id": 15, "pad_token_id": 0},
                                    {"pad_token_id": None}, {"rms_norm_eps": 1e-5, "tie_word_embeddings": True}])
def test_valid_fields_pass(fields):
    spec = model_spec({**TINY, **fields})
    assert spec.tie_word_embeddings == fields.get("tie_word_embeddings", False)


@pytest.mark.parametrize("fields, key", [
    ({"eos_token_id": [0, 16]}, "eos_token_id"), ({"eos_token_id": [0, None]}, "eos_token_id"),
    ({"bos_token_id": 1.0}, "bos_token_id"), ({"pad_token_id": True}, "pad_token_id"),
    ({"rms_norm_eps": -1e-6}, "rms_norm_eps"), ({"rms_norm_eps": math.inf}, "rms_norm_eps"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings"),
])
def test_invalid_fields_are_named(fields, key):
    with pytest.raises(ConfigError) as err:
        model_spec({**TINY, **fields}, "model.hf_config")
    assert err.value.key == f"model.hf_config.{key}"


@pytest.mark.parametrize("result, expected", [(1, {"score": 1.0}), ({"score": 0.5, "acc": True},
                                                                     {"score": 0.5, "acc": 1.0})])
def test_score_one_normalizes(result, expected):
    assert score_one(lambda *a: result, "s", "", None, None, {}, where="here") == expected


@pytest.mark.parametrize("result, text", [(math.inf, "non-finite"), ({"acc": 1}, "without 'score'"),
                                          ("1x", "non-numeric")])
def test_score_one_refuses(result, text):
    with pytest.raises(RewardFunctionError, match=text):
        score_one(lambda *a: result, "s", "", None, None, {}, where=lambda: "here")
