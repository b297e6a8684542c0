"""Generation shards (Megatron names, TP = t_g) -> the tensors a vLLM engine loads.

After :meth:`~megaflow.hybrid_engine.reshard.MicroDPResharder.to_generation` every rank
holds its generation shard as megatron-core tensors with global layer names and the
Megatron layouts (``linear_qkv`` grouped per KV group, ``linear_fc1`` = [gate; up] of the
shard, vocabulary padded for the training TP). Two routes into vLLM
(:meth:`megaflow.rollout.VLLMRollout.update_weights`):

* ``t_g == 1`` -> :func:`hf_full_tensors`: the generation shard is the whole model; it is
  unfused into Hugging Face names and full tensors (``format="hf_full"``).
* ``t_g > 1`` -> :func:`vllm_sharded_tensors`: the rank's shard maps one-to-one onto its
  vLLM shard (``format="sharded"``); only ``linear_qkv`` rows are reordered (vLLM keeps
  all local q heads, then k, then v). The vocabulary tensors are the exception: Megatron
  pads the vocabulary to a multiple of ``128 * t`` and vLLM to a multiple of 64, so their
  row ranges per rank differ; they are all-gathered over the generation TP group
  (``vocab * hidden`` elements) and re-cut to vLLM's ranges.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Mapping

import torch

from megaflow.models.hf_mapping import ModelSpec, find_mapping, hf_names, megatron_shards_to_hf
from megaflow.models.transforms import megatron_qkv_to_vllm

#: megatron-core leaf name -> vLLM leaf name (Llama/Qwen2 in vLLM's model definitions).
_VLLM_LAYER_NAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
    "self_attention.linear_qkv.bias": "self_attn.qkv_proj.bias",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}
_VLLM_GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}
_VOCAB_PARAMS = ("embedding.word_embeddings.weight", "output_layer.weight")
_LAYER_PREFIX = "decoder.layers."


def hf_full_tensors(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Unfuse a whole-model generation shard (t_g = 1) into HF names and full tensors.

    Args:
        named: ``(megatron name, tensor)`` with global layer indices, TP = 1 layouts.
        spec: the model's :class:`~megaflow.models.hf_mapping.ModelSpec`.

    Yields:
        ``(hf name, tensor)``; vocabulary padding removed, QKV and gate/up split. The tied
        output layer is skipped (vLLM ties it to the embedding itself).
    """
    for name, tensor in named:
        row, layer = find_mapping(name, spec)
        if row.tied_hf and spec.tie_word_embeddings:
            continue
        for hf_name, hf_tensor in zip(hf_names(row, spec, layer), megatron_shards_to_hf(row, [tensor], spec)):
            yield hf_name, hf_tensor


def vllm_name(megatron_name: str) -> str:
    """vLLM parameter name of a megatron-core generation-shard name (global layer index).

    Raises:
        KeyError: a name outside the Llama/Qwen2 mapping.
    """
    if megatron_name in _VLLM_GLOBAL_NAMES:
        return _VLLM_GLOBAL_NAMES[megatron_name]
    if megatron_name.startswith(_LAYER_PREFIX):
        layer, _, leaf = megatron_name[len(_LAYER_PREFIX):].partition(".")
        if leaf in _VLLM_LAYER_NAMES:
            return f"model.layers.{int(layer)}.{_VLLM_LAYER_NAMES[leaf]}"
    raise KeyError(f"no vLLM name for megatron parameter {megatron_name!r}")


def _vllm_vocab_rows(full_padded: torch.Tensor, vocab_size: int, rows_per_rank: int, rank: int) -> torch.Tensor:
    """Rows ``[rank * rows_per_rank, (rank + 1) * rows_per_rank)`` of the vocabulary,
    zero beyond the real ``vocab_size`` rows."""
    start = rank * rows_per_rank
    out = full_padded.new_zeros((rows_per_rank, *full_padded.shape[1:]))
    real = max(0, min(vocab_size, start + rows_per_rank) - start)
    if real:
        out[:real] = full_padded[start:start + real]
    return out


def vllm_sharded_tensors(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec, *, gen_tp: int,
                         gen_tp_rank: int, vllm_shapes: Mapping[str, tuple[int, ...]],
                         gather_vocab: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """Convert this rank's generation shard (TP = ``gen_tp``) into its vLLM shard.

    Args:
        named: ``(megatron name, shard)`` with global layer indices.
        spec: the model spec (head counts for the QKV reorder, real vocabulary size).
        gen_tp, gen_tp_rank: generation TP size and this rank's position in its group.
        vllm_shapes: vLLM name -> this rank's expected shard shape
            (:meth:`VLLMRollout.sharded_param_shapes`); every yielded tensor is checked.
        gather_vocab: all-gathers a vocabulary shard over the generation TP group along
            dim 0 (collective: every rank of the group calls it for the same tensors in the
            same order).

    Yields:
        ``(vLLM name, shard)``. The tied output layer is skipped.

    Raises:
        KeyError / ValueError: an unmapped name or a shard whose shape differs from vLLM's
            (e.g. KV-head replication that vLLM lays out differently), naming both shapes.
    """
    for name, tensor in named:
        if name == "output_layer.weight" and spec.tie_word_embeddings:
            continue
        target = vllm_name(name)
        if target not in vllm_shapes:
            raise KeyError(f"vLLM has no parameter {target!r} (from {name!r})")
        shape = tuple(vllm_shapes[target])
        if name in _VOCAB_PARAMS:
            tensor = _vllm_vocab_rows(gather_vocab(tensor), spec.vocab_size, shape[0], gen_tp_rank)
        elif name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
            tensor = megatron_qkv_to_vllm(tensor, num_heads=spec.num_heads // gen_tp,
                                          num_kv_heads=max(1, spec.num_kv_heads // gen_tp),
                                          head_dim=spec.head_dim)
        if tuple(tensor.shape) != shape:
            raise ValueError(f"generation shard {name!r} has shape {tuple(tensor.shape)} but vLLM's "
                             f"{target!r} expects {shape} on this rank")
        yield target, tensor


__all__ = ["hf_full_tensors", "vllm_sharded_tensors", "vllm_name"]
