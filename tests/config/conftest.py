"""Shared inputs of the config tests: a minimal valid config tree over the defaults."""
import copy

import pytest

TINY_HF = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 16,
}


def tiny_tree(**sections):
    """The smallest valid config tree (inline tiny Llama, arith task), ``sections`` merged in."""
    tree = {"model": {"hf_config": copy.deepcopy(TINY_HF), "tokenizer": "arith"},
            "data": {"task": "arith", "train_batch_size": 16},
            "resources": {"use_gpu": False}}
    for name, values in sections.items():
        tree.setdefault(name, {}).update(values)
    return tree


@pytest.fixture
def tiny():
    return tiny_tree
