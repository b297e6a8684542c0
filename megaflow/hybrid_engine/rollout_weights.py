"""Generation shards (Megatron names, TP = t_g) -> the tensors a vLLM engine loads, in buckets.

After :meth:`~megaflow.hybrid_engine.reshard.MicroDPResharder.to_generation` every rank
holds its generation shard as megatron-core tensors with global layer names and the
Megatron layouts (``linear_qkv`` grouped per KV group, ``linear_fc1`` = [gate; up] of the
shard, vocabulary padded for the training TP). One route takes it into vLLM at every
t_g (t_g = 1 is the one-shard case): each tensor is renamed and re-laid out into the
engine's local shard (:func:`vllm_param_name`, :func:`to_vllm_shard`) and pushed in
buckets (:func:`iter_vllm_buckets`) through
:meth:`megaflow.rollout.vllm_rollout.VLLMRollout.load_weight_bucket`.

The name table is derived, not restated: the Megatron -> Hugging Face rows of
:mod:`megaflow.models.hf_mapping` give the HF names; vLLM keeps the HF names except for
the modules it packs (:data:`VLLM_PACKED_MODULES`, vLLM's own
``LlamaForCausalLM.packed_modules_mapping`` / ``Qwen2ForCausalLM.packed_modules_mapping``),
whose HF source tensors are exactly the ones a fused Megatron row joins. Layouts:

* ``linear_qkv`` (row transform ``"qkv"``): Megatron interleaves q, k, v per KV group,
  vLLM keeps all local q heads, then k, then v; rows are reordered
  (:func:`megaflow.models.transforms.megatron_qkv_to_vllm`).
* ``linear_fc1`` (``"gate_up"``): the shard ``[gate_local; up_local]`` is vLLM's
  ``gate_up_proj`` shard as it is; row-parallel weights and norms likewise.
* vocabulary rows (``"vocab"``): Megatron pads the vocabulary to a multiple of
  ``128 * t`` and vLLM to a multiple of 64, so the row ranges per rank can differ; then
  the shards are all-gathered over the generation TP group (``vocab * hidden``
  elements) and re-cut to vLLM's ranges, rows past the real vocabulary zero. Where the
  paddings agree the shard is vLLM's as it is.

Memory: tensors are produced lazily from the resharder's iterator, converted one at a
time and handed out in buckets of at most ``bucket_bytes`` (a bucket is handed out before
the next tensor is converted); with a consumer that drops each bucket after loading it,
the extra memory during a sync is the generation shard plus one bucket, plus the one
generation tensor the resharder has materialised ahead (``linear_fc1`` or a row-parallel
weight when t_g < t) (``tools/bench_reshard.py`` measures it).
"""
from __future__ import annotations

import math
from typing import Callable, Iterable, Iterator, Mapping, Optional

import torch
import torch.distributed as dist

from megaflow.models.hf_mapping import ModelSpec, find_mapping
from megaflow.models.transforms import megatron_qkv_to_vllm

from .reshard import _all_gather_flat

#: vLLM module that packs several HF modules -> the HF modules, in packing order
#: (vLLM 0.32 ``packed_modules_mapping`` of ``LlamaForCausalLM`` and ``Qwen2ForCausalLM``;
#: tests/rollout checks the two tables are still these).
VLLM_PACKED_MODULES: Mapping[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def vllm_param_name(megatron_name: str, spec: ModelSpec) -> Optional[str]:
    """The vLLM parameter that receives a megatron-core generation-shard tensor.

    Args:
        megatron_name: megatron-core GPTModel name with a *global* layer index, e.g.
            ``decoder.layers.3.self_attention.linear_qkv.weight``.
        spec: the model spec (selects the active rows: QKV bias, head kind, tying).

    Returns:
        The vLLM name (e.g. ``model.layers.3.self_attn.qkv_proj.weight``), or None for a
        tied output layer (vLLM's ``lm_head`` shares the embedding's parameter).

    Raises:
        KeyError: a name outside the :mod:`~megaflow.models.hf_mapping` table, or a fused
            row whose HF modules vLLM does not pack into one parameter.
    """
    row, layer = find_mapping(megatron_name, spec)
    if row.tied_hf and spec.tie_word_embeddings:
        return None
    hf = [name.format(layer=layer) for name in row.hf]
    if len(hf) == 1:
        return hf[0]
    prefix, _, param = hf[0].rpartition(".")
    parent, _, first_module = prefix.rpartition(".")
    modules = tuple(name.rpartition(".")[0].rpartition(".")[2] for name in hf)
    for packed, sources in VLLM_PACKED_MODULES.items():
        if sources == modules:
            return f"{parent}.{packed}.{param}"
    raise KeyError(f"megatron parameter {megatron_name!r} fuses HF modules {modules} that vLLM does not "
                   f"pack into one parameter (known: {dict(VLLM_PACKED_MODULES)})")


def gather_rows(shard: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-gather ``shard`` along dim 0 over ``group`` into one new tensor (collective).

    Args:
        shard: ``[rows, ...]``, the same shape on every rank of ``group``.
        group: the generation TP group; None (t_g = 1): ``shard`` itself is returned.

    Returns:
        ``[group_size * rows, ...]``, rank ``i``'s rows at ``[i * rows, (i + 1) * rows)``
        (one output buffer, no per-rank copies).
    """
    if group is None:
        return shard
    out = shard.new_empty((dist.get_world_size(group) * shard.shape[0], *shard.shape[1:]))
    _all_gather_flat(out, shard.contiguous(), group=group)
    return out


def _vllm_vocab_rows(shard: torch.Tensor, vocab_size: int, rows_per_rank: int, rank: int,
                     gather_vocab: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """vLLM's vocabulary rows ``[rank * rows_per_rank, (rank + 1) * rows_per_rank)``, zero
    beyond the real ``vocab_size`` rows, from this rank's Megatron rows ``shard``.

    When both paddings give a rank the same rows the shard is used as it is (no gather;
    the decision depends on shapes only, so every rank of the group takes the same branch).
    """
    start = rank * rows_per_rank
    real = max(0, min(vocab_size, start + rows_per_rank) - start)
    if shard.shape[0] == rows_per_rank:
        if real == rows_per_rank:
            return shard
        out = shard.clone()
        out[real:] = 0
        return out
    full_padded = gather_vocab(shard)
    out = full_padded.new_zeros((rows_per_rank, *full_padded.shape[1:]))
    if real:
        out[:real] = full_padded[start:start + real]
    return out


def to_vllm_shard(megatron_name: str, tensor: torch.Tensor, spec: ModelSpec, *, gen_tp: int, gen_tp_rank: int,
                  vllm_shapes: Mapping[str, tuple[int, ...]],
                  gather_vocab: Callable[[torch.Tensor], torch.Tensor]) -> Optional[tuple[str, torch.Tensor]]:
    """Rename and re-lay out one generation-shard tensor into this rank's vLLM shard.

    Args:
        megatron_name, tensor: one ``(global megatron name, TP = gen_tp shard)`` pair of
            :meth:`~megaflow.hybrid_engine.reshard.MicroDPResharder.named_generation_tensors`.
        spec: head counts (QKV reorder) and the real vocabulary size.
        gen_tp, gen_tp_rank: generation TP size t_g and this rank's position in its group.
        vllm_shapes: vLLM name -> this rank's shard shape (the engine's
            :meth:`~megaflow.rollout.vllm_rollout.VLLMRollout.sharded_param_shapes`).
        gather_vocab: all-gathers a vocabulary shard ``[V_megatron / t_g, hidden]`` over the
            generation TP group along dim 0 (collective; identity at t_g = 1).

    Returns:
        ``(vLLM name, shard)`` — a view of ``tensor`` where the layouts agree, a new tensor
        otherwise — or None for a tied output layer.

    Raises:
        KeyError: an unmapped name, or a vLLM name the engine does not have.
        ValueError: a converted shard whose shape differs from vLLM's (both named).
    """
    target = vllm_param_name(megatron_name, spec)
    if target is None:
        return None
    if target not in vllm_shapes:
        raise KeyError(f"vLLM has no parameter {target!r} (from {megatron_name!r})")
    shape = tuple(vllm_shapes[target])
    transform = find_mapping(megatron_name, spec)[0].transform
    if transform == "vocab":
        tensor = _vllm_vocab_rows(tensor, spec.vocab_size, shape[0], gen_tp_rank, gather_vocab)
    elif transform == "qkv":
        tensor = megatron_qkv_to_vllm(tensor, num_heads=spec.num_heads // gen_tp,
                                      num_kv_heads=max(1, spec.num_kv_heads // gen_tp), head_dim=spec.head_dim)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"generation shard {megatron_name!r} has shape {tuple(tensor.shape)} but vLLM's "
                         f"{target!r} expects {shape} on this rank")
    return target, tensor


def iter_vllm_buckets(named: Iterable[tuple[str, torch.Tensor]], spec: ModelSpec, *, gen_tp: int,
                      gen_tp_rank: int, vllm_shapes: Mapping[str, tuple[int, ...]],
                      gather_vocab: Callable[[torch.Tensor], torch.Tensor],
                      bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Stream this rank's generation shard as buckets of vLLM-layout tensors.

    Args:
        named: ``(global megatron name, TP = gen_tp shard)`` pairs, consumed lazily (the
            resharder's :meth:`~megaflow.hybrid_engine.reshard.MicroDPResharder.named_generation_tensors`).
        spec, gen_tp, gen_tp_rank, vllm_shapes, gather_vocab: as in :func:`to_vllm_shard`.
            Every rank of a generation TP group must iterate the same names in the same
            order (``gather_vocab`` is a collective).
        bucket_bytes: the most bytes (``numel * element_size`` summed) one bucket holds;
            a single larger tensor forms a bucket of its own.

    Yields:
        Lists of ``(vLLM parameter name, tensor in the engine's local shard layout)``, in
        the order of ``named``, tied output layer left out. A bucket is built only when the
        consumer asks for it; drop it after loading so that at most one is alive.

    Raises:
        ValueError: ``bucket_bytes <= 0``, or a shard of the wrong shape (see
            :func:`to_vllm_shard`).
        KeyError: an unmapped name.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"iter_vllm_buckets: bucket_bytes must be > 0, got {bucket_bytes}")
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        target = vllm_param_name(name, spec)
        if target is None:
            continue
        # the converted size is known before converting: hand out the full bucket first
        nbytes = math.prod(vllm_shapes.get(target, tensor.shape)) * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        converted = to_vllm_shard(name, tensor, spec, gen_tp=gen_tp, gen_tp_rank=gen_tp_rank,
                                  vllm_shapes=vllm_shapes, gather_vocab=gather_vocab)
        del tensor
        bucket.append(converted)
        size += nbytes
        del converted
    if bucket:
        yield bucket


__all__ = ["VLLM_PACKED_MODULES", "vllm_param_name", "to_vllm_shard", "iter_vllm_buckets", "gather_rows"]
