"""Test helpers for the Megatron engine: tiny HF models, an independent HF -> megatron-core
shard converter (deliberately separate from megaflow.models so the two check each other),
and batches with left-padded prompts and right-padded responses.

Per-rank functions for ``run_distributed`` live in the test modules; they import this one.
"""
from __future__ import annotations

import torch

VOCAB = 200


def tiny_llama_config(**overrides):
    """A 4-layer GQA Llama (4 heads, 2 KV heads) small enough for 4 CPU ranks."""
    from transformers import LlamaConfig

    kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=False, initializer_range=0.1)
    kwargs.update(overrides)
    return LlamaConfig(**kwargs)


def tiny_qwen2_config(**overrides):
    from transformers import Qwen2Config

    kwargs = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                  max_position_embeddings=64, tie_word_embeddings=True, initializer_range=0.1)
    kwargs.update(overrides)
    return Qwen2Config(**kwargs)


def hf_causal_lm(config, seed: int = 0):
    """Random-init HF causal LM (fp32, eval mode); biases randomised too (Qwen2 QKV bias)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # non-trivial norms and biases
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _fuse_qkv(q, k, v, heads, kv_heads, head_dim):
    """HF q/k/v -> Megatron linear_qkv rows grouped per KV head: [q.. k v] per group."""
    per_group = heads // kv_heads
    q = q.reshape(kv_heads, per_group * head_dim, *q.shape[1:])
    k = k.reshape(kv_heads, head_dim, *k.shape[1:])
    v = v.reshape(kv_heads, head_dim, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _pad_rows(weight, padded):
    out = torch.zeros(padded, *weight.shape[1:], dtype=weight.dtype)
    out[: weight.shape[0]] = weight
    return out


def hf_to_megatron_shard(hf_state: dict, config, *, tp_rank: int, tp: int, pp_rank: int, pp: int,
                         head: str = "lm", score_weight=None) -> dict:
    """Full HF state dict -> the megatron-core (local spec) state dict of one TP/PP shard."""
    from megaflow.megatron.model import padded_vocab_size

    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    layers_per_stage = config.num_hidden_layers // pp
    padded = padded_vocab_size(config.vocab_size, tp)

    def chunk(t, dim):
        return t.chunk(tp, dim=dim)[tp_rank].clone()

    out = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = chunk(
            _pad_rows(hf_state["model.embed_tokens.weight"], padded), 0)
    for local in range(layers_per_stage):
        g = pp_rank * layers_per_stage + local
        src, dst = f"model.layers.{g}.", f"decoder.layers.{local}."
        qkv = _fuse_qkv(hf_state[src + "self_attn.q_proj.weight"], hf_state[src + "self_attn.k_proj.weight"],
                        hf_state[src + "self_attn.v_proj.weight"], heads, kv, head_dim)
        out[dst + "self_attention.linear_qkv.weight"] = chunk(qkv, 0)
        if src + "self_attn.q_proj.bias" in hf_state:
            qkv_b = _fuse_qkv(hf_state[src + "self_attn.q_proj.bias"], hf_state[src + "self_attn.k_proj.bias"],
                              hf_state[src + "self_attn.v_proj.bias"], heads, kv, head_dim)
            out[dst + "self_attention.linear_qkv.bias"] = chunk(qkv_b, 0)
        out[dst + "self_attention.linear_proj.weight"] = chunk(hf_state[src + "self_attn.o_proj.weight"], 1)
        out[dst + "input_layernorm.weight"] = hf_state[src + "input_layernorm.weight"].clone()
        out[dst + "pre_mlp_layernorm.weight"] = hf_state[src + "post_attention_layernorm.weight"].clone()
        gate, up = hf_state[src + "mlp.gate_proj.weight"], hf_state[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat([chunk(gate, 0), chunk(up, 0)], dim=0)
        out[dst + "mlp.linear_fc2.weight"] = chunk(hf_state[src + "mlp.down_proj.weight"], 1)
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = hf_state["model.norm.weight"].clone()
        if head != "lm":
            out["output_layer.weight"] = score_weight.clone()
        elif not config.tie_word_embeddings:
            out["output_layer.weight"] = chunk(_pad_rows(hf_state["lm_head.weight"], padded), 0)
        elif pp > 1:  # tied: the last stage keeps a copy of the embedding
            out["output_layer.weight"] = chunk(_pad_rows(hf_state["model.embed_tokens.weight"], padded), 0)
    return out


def load_shard(model: torch.nn.Module, shard: dict) -> None:
    """Copy ``shard`` into ``model``; the tensor key sets must match exactly."""
    params = {k: v for k, v in model.state_dict().items() if torch.is_tensor(v) and not k.endswith("_extra_state")}
    missing, extra = sorted(set(params) - set(shard)), sorted(set(shard) - set(params))
    assert not missing and not extra, f"missing {missing}, extra {extra}"
    with torch.no_grad():
        for name, value in shard.items():
            assert params[name].shape == value.shape, (name, params[name].shape, value.shape)
            params[name].copy_(value)


def make_batch(seed: int, batch: int = 6, prompt_len: int = 7, response_len: int = 6,
               vocab: int = VOCAB) -> dict:
    """verl-layout batch: left-padded prompts + right-padded responses, ragged lengths.

    Row 0 has the full prompt and response; other rows have random prompt/response lengths
    (>= 1 prompt token, >= 1 response token).
    """
    g = torch.Generator().manual_seed(seed)
    seq = prompt_len + response_len
    input_ids = torch.randint(0, vocab, (batch, seq), generator=g)
    attention_mask = torch.zeros(batch, seq, dtype=torch.int64)
    for row in range(batch):
        p = prompt_len if row == 0 else int(torch.randint(1, prompt_len + 1, (1,), generator=g))
        r = response_len if row == 0 else int(torch.randint(1, response_len + 1, (1,), generator=g))
        attention_mask[row, prompt_len - p: prompt_len + r] = 1
    input_ids = torch.where(attention_mask.bool(), input_ids, torch.zeros_like(input_ids))
    position_ids = (attention_mask.cumsum(-1) - 1).clamp_min(0)
    responses = input_ids[:, prompt_len:]
    response_mask = attention_mask[:, prompt_len:].clone()
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                responses=responses, response_mask=response_mask)


def hf_reference(model, batch: dict, temperature: float = 1.0) -> dict:
    """Per-token log-probs/entropy of the response under an HF causal LM (the oracle).

    log-prob of the token at position t comes from the logits at position t - 1.
    """
    resp_len = batch["responses"].shape[1]
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"])
    logits = out.logits[:, -resp_len - 1:-1].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    log_probs = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return dict(log_probs=log_probs, entropy=entropy)


def hf_values_reference(model, batch: dict, score_weight: torch.Tensor) -> torch.Tensor:
    """Per-token values ``[batch, response_len]``: final hidden state at t - 1 @ score.T."""
    resp_len = batch["responses"].shape[1]
    hidden = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         position_ids=batch["position_ids"]).last_hidden_state
    return (hidden[:, -resp_len - 1:-1] @ score_weight.T).squeeze(-1)


def batch_with_advantages(seed: int = 0, advantage_seed: int = 5) -> dict:
    """:func:`make_batch` plus seeded N(0, 1) ``advantages`` ``[batch, response_len]``."""
    batch = make_batch(seed)
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(advantage_seed))
    return batch


def token_mean_policy_loss(outputs: dict, mb: dict, den) -> tuple:
    """Engine loss callback: token-mean policy gradient ``-sum(log_prob * A * mask) / N`` with the
    global token count ``N`` (``den.num_tokens``); no metrics."""
    mask = mb["response_mask"].float()
    return -(outputs["log_probs"] * mb["advantages"] * mask).sum() / den.num_tokens, {}
