"""Tiny random Qwen3-MoE models for the MoE tests (conversion, engine, expert parallelism)."""
from __future__ import annotations

import torch

NUM_EXPERTS = 4


def tiny_moe_config(vocab_size: int, norm_topk_prob: bool = True):
    """A 2-layer Qwen3-MoE: hidden 64, 4 heads / 2 KV heads of 16 (q/k norms), 4 SwiGLU
    experts of width 32, top-2 routing, untied embeddings."""
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=NUM_EXPERTS, num_experts_per_tok=2, norm_topk_prob=norm_topk_prob,
                            max_position_embeddings=64, tie_word_embeddings=False)
    config.architectures = ["Qwen3MoeForCausalLM"]
    return config


def tiny_moe_model(vocab_size: int, norm_topk_prob: bool = True, seed: int = 0):
    """A random fp32 Qwen3-MoE in eval mode; every parameter (router and norms included) is
    perturbed with a seeded generator, so a mapping that swaps or drops a tensor shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(vocab_size, norm_topk_prob), dtype=torch.float32)
    return perturb_(model, seed + 1).eval()


def perturb_(model: torch.nn.Module, seed: int, scale: float = 0.05) -> torch.nn.Module:
    """Add seeded N(0, scale^2) noise to every parameter in place (also used by hf_tiny)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale)
    return model
