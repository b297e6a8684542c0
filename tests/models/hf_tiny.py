"""Tiny random Llama / Qwen2 / Qwen3 checkpoints built in-process from transformers configs.

Every parameter (norms and biases included) is perturbed with a seeded generator, so a
mapping that swaps, drops or mis-orders any tensor changes the logits.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from moe_testlib import perturb_

VOCAB = 300  # not a multiple of 128: padded to 384 at TP=1, 512 at TP=2
VARIANTS = {
    # name: (model_type, num_attention_heads, num_key_value_heads, tie_word_embeddings)
    "llama_gqa_untied": ("llama", 4, 2, False),
    "llama_gqa_tied": ("llama", 4, 2, True),
    "qwen2_bias_tied": ("qwen2", 4, 2, True),
    "qwen2_bias_untied": ("qwen2", 4, 4, False),
    "llama_mqa": ("llama", 4, 1, False),  # TP=2 > 1 KV head: KV replication
    "qwen3_qknorm_tied": ("qwen3", 4, 2, True),  # q/k norms
}
CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def tiny_config(variant: str, num_layers: int = 4):
    """A transformers config for ``variant`` (hidden 64, head_dim 16, ffn 96)."""
    import transformers

    model_type, heads, kv_heads, tie = VARIANTS[variant]
    cls = getattr(transformers, CONFIG_CLASSES[model_type])
    config = cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, head_dim=16,
                 num_hidden_layers=num_layers, num_attention_heads=heads,
                 num_key_value_heads=kv_heads, max_position_embeddings=64, rms_norm_eps=1e-6,
                 tie_word_embeddings=tie, rope_parameters={"rope_type": "default",
                                                           "rope_theta": 10000.0},
                 bos_token_id=1, eos_token_id=2, pad_token_id=2)
    config.architectures = [ARCHITECTURES[model_type]]
    return config


def tiny_model(variant: str, seed: int = 0, num_layers: int = 4):
    """A random fp32 causal LM in eval mode."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(variant, num_layers), dtype=torch.float32)
    return perturb_(model, seed + 1).eval()


def save_tiny_tokenizer(directory: Path) -> None:
    """A word-level tokenizer with VOCAB tokens (to check files are copied through)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>", pad_token="</s>").save_pretrained(directory)


def save_tiny_hf_dir(variant: str, directory: Path, seed: int = 0) -> Path:
    """Save model + tokenizer of ``variant`` as an HF directory; returns it."""
    model = tiny_model(variant, seed)
    model.save_pretrained(directory, safe_serialization=True)
    save_tiny_tokenizer(directory)
    return directory


def replicated_kv_config(config, num_kv_heads: int):
    """``config`` with more KV heads: the layout megatron-core builds for TP > KV heads."""
    out = copy.deepcopy(config)
    out.num_key_value_heads = num_kv_heads
    return out


@torch.no_grad()
def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, seq, vocab]`` logits of a transformers model (no padding)."""
    return model(input_ids=input_ids).logits.float()
