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


def tiny_vllm_moe_model(seed: int):
    """A random fp32 Qwen3-MoE vLLM's CPU kernels serve (head_dim 32, hidden and expert width
    multiples of 32): 2 layers, hidden 128, 4 heads / 2 KV heads, 4 experts of width 64, top-2,
    vocabulary 250 (not a multiple of 64), untied, eos = pad = 2. The router is scaled up so
    routing is decisive (few near-ties between the k-th and (k+1)-th expert) and the LM head x10
    for greedy continuations without near-ties."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=250, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=NUM_EXPERTS, num_experts_per_tok=2, norm_topk_prob=True,
                            max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                            pad_token_id=2)
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_(model, seed + 100, scale=0.02)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
        for layer in model.model.layers:
            layer.mlp.gate.weight.mul_(20.0)
    return model.eval()


@torch.no_grad()
def hf_routed_experts(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts ``transformers`` routes each token to, from the router logits themselves.

    Every MoE block's input is captured (a forward pre-hook) and its router logits recomputed
    as ``hidden @ gate.weight.T``. Unpadded sequences (positions ``0 .. seq-1``).

    Returns:
        ``(ids, margin)``: ids ``[batch, seq, layers, topk]`` int64, the top-k of the logits
        (softmax is monotonic, so also of the probabilities); margin ``[batch, seq, layers]``,
        the gap between the k-th and the (k+1)-th largest logit (small = a near-tie).
    """
    inputs: list[torch.Tensor] = []
    hooks = [layer.mlp.register_forward_pre_hook(lambda _m, args: inputs.append(args[0]))
             for layer in model.model.layers]
    try:
        model(input_ids=input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    k = model.config.num_experts_per_tok
    ids, margins = [], []
    for layer, hidden in zip(model.model.layers, inputs, strict=True):
        logits = hidden.float() @ layer.mlp.gate.weight.float().T  # [batch, seq, experts]
        top = logits.topk(k + 1, dim=-1)
        ids.append(top.indices[..., :k])
        margins.append(top.values[..., k - 1] - top.values[..., k])
    return torch.stack(ids, dim=2), torch.stack(margins, dim=2)


#: Row order of ``megatron_testlib.make_batch(0)`` that gives two DP ranks different longest
#: rows (lengths 13, 13, 4 | 9, 10, 8), so EP = 2 needs the engine's common width.
UNEVEN_DP_ORDER = (0, 4, 5, 1, 2, 3)


def saved_moe_case(hf_dir, batch: dict, vocab_size: int):
    """A :func:`tiny_moe_model` saved under ``hf_dir``, ``batch`` in :data:`UNEVEN_DP_ORDER`, and
    ``transformers``' own top-k routing of it ``[batch, seq, layers, topk]`` (int64, from the
    router logits, unordered within k).

    Returns:
        ``(model, batch, routing)``.
    """
    hf = tiny_moe_model(vocab_size)
    hf.save_pretrained(hf_dir)
    batch = {k: v[list(UNEVEN_DP_ORDER)] for k, v in batch.items()}
    with torch.no_grad():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    position_ids=batch["position_ids"], output_router_logits=True).router_logits
    shape = (*batch["input_ids"].shape, -1)
    k = hf.config.num_experts_per_tok
    return hf, batch, torch.stack([layer.float().topk(k, dim=-1).indices.view(shape) for layer in logits], dim=2)


def moe_actor_engine(hf_dir, overrides: list[str], vocab_size: int):
    """In a 2-process gloo world: the actor's MegatronEngine of the model saved at ``hf_dir``
    (:func:`saved_moe_case`) at 32-token sequences, TP = 1 and ``overrides``; initialises
    megatron's parallel state (the caller destroys it).

    Returns:
        ``(engine, info)``.
    """
    from role_testlib import role_spec, seq_len_overrides
    from transformers import AutoConfig

    from megaflow.megatron import parallel
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.megatron.model import build_gpt_model
    from megaflow.models.weights import load_hf_weights

    spec = role_spec("actor", ["resources.procs_per_node=2", "actor.tp=1", *seq_len_overrides(32), *overrides],
                     hf_config=tiny_moe_config(vocab_size))
    par = spec.parallel
    info = parallel.initialize_parallel(tp=par.tp, pp=par.pp, ep=par.ep, seed=1)
    config = AutoConfig.from_pretrained(hf_dir)
    model = build_gpt_model(config, **spec.model_overrides)
    load_hf_weights(model, hf_dir, config, info)
    return MegatronEngine(model, info, spec, vocab_size=vocab_size), info
