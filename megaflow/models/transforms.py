"""Pure tensor transforms between Hugging Face and megatron-core parameter layouts.

Every function here is pure (no process groups, no global state) and works on weights
``[out_features, in_features]`` as well as on biases ``[out_features]``: the transformed
dimension is always dim 0 unless stated otherwise.

Layouts (``head_dim`` = d, query heads per KV group = ``n_rep = num_heads / num_kv_heads``):

* HF: ``q_proj [num_heads * d, h]``, ``k_proj``/``v_proj [num_kv_heads * d, h]``, query
  head ``j`` belongs to KV group ``j // n_rep`` (``repeat_kv`` in ``modeling_llama.py``).
* Megatron ``linear_qkv [(num_heads + 2 * num_kv_heads) * d, h]``: for each KV group g,
  its ``n_rep`` query heads, then its key head, then its value head
  (``SelfAttention.get_query_key_value_tensors`` in megatron-core). Because groups are
  contiguous, the TP shard of rank r is the contiguous block of groups
  ``[r * G / tp, (r + 1) * G / tp)``.
* Megatron ``linear_fc1 [2 * ffn, h]`` on one TP rank: the rank's gate chunk, then its up
  chunk (``SwiGLU`` splits the local output in two halves). The global (TP=1) tensor is
  ``[gate; up]``; a TP shard is *not* a contiguous slice of it.
* vLLM ``qkv_proj`` on one TP rank: all local q heads, then all local k, then all local v.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def _check_divisible(value: int, divisor: int, what: str) -> None:
    if divisor <= 0 or value % divisor != 0:
        raise ValueError(f"{what}: {value} is not divisible by {divisor}")


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, num_heads: int,
             num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Fuse HF ``q/k/v`` projections into Megatron's ``linear_qkv`` (grouped per KV head).

    Args:
        q: ``[num_heads * head_dim, ...]`` (weight ``[.., hidden]`` or bias ``[..]``).
        k, v: ``[num_kv_heads * head_dim, ...]``.
        num_heads, num_kv_heads, head_dim: of the tensors passed (global or one TP shard).

    Returns:
        ``[(num_heads + 2 * num_kv_heads) * head_dim, ...]``: per KV group, its q heads,
        then k, then v.

    Raises:
        ValueError: when the shapes do not match the head counts.
    """
    _check_divisible(num_heads, num_kv_heads, "num_heads vs num_kv_heads")
    n_rep = num_heads // num_kv_heads
    tail = q.shape[1:]
    expected = {"q": (num_heads * head_dim, *tail), "k": (num_kv_heads * head_dim, *tail),
                "v": (num_kv_heads * head_dim, *tail)}
    for name, t in (("q", q), ("k", k), ("v", v)):
        if tuple(t.shape) != expected[name]:
            raise ValueError(f"fuse_qkv: {name} has shape {tuple(t.shape)}, expected "
                             f"{expected[name]}")
    q = q.reshape(num_kv_heads, n_rep * head_dim, *tail)
    k = k.reshape(num_kv_heads, head_dim, *tail)
    v = v.reshape(num_kv_heads, head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail).contiguous()


def split_qkv(qkv: torch.Tensor, *, num_heads: int, num_kv_heads: int,
              head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`: Megatron ``linear_qkv`` -> HF ``(q, k, v)``.

    Args:
        qkv: ``[(num_heads + 2 * num_kv_heads) * head_dim, ...]`` in Megatron layout.

    Returns:
        ``q [num_heads * head_dim, ...]``, ``k`` and ``v [num_kv_heads * head_dim, ...]``.
    """
    _check_divisible(num_heads, num_kv_heads, "num_heads vs num_kv_heads")
    n_rep = num_heads // num_kv_heads
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv.shape[0] != rows:
        raise ValueError(f"split_qkv: linear_qkv has {qkv.shape[0]} rows, expected {rows} "
                         f"(num_heads={num_heads}, num_kv_heads={num_kv_heads}, "
                         f"head_dim={head_dim})")
    tail = qkv.shape[1:]
    grouped = qkv.reshape(num_kv_heads, (n_rep + 2) * head_dim, *tail)
    q, k, v = torch.split(grouped, [n_rep * head_dim, head_dim, head_dim], dim=1)
    return (q.reshape(-1, *tail).contiguous(), k.reshape(-1, *tail).contiguous(),
            v.reshape(-1, *tail).contiguous())


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF ``gate_proj``/``up_proj`` ``[ffn, hidden]`` (of one TP shard) -> ``linear_fc1``
    ``[2 * ffn, hidden]`` = ``[gate; up]``."""
    if gate.shape != up.shape:
        raise ValueError(f"fuse_gate_up: gate {tuple(gate.shape)} and up {tuple(up.shape)} "
                         "differ in shape")
    return torch.cat([gate, up], dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_gate_up`: ``[2 * ffn, hidden]`` -> ``(gate, up)``."""
    if fc1.shape[0] % 2 != 0:
        raise ValueError(f"split_gate_up: linear_fc1 has an odd number of rows {fc1.shape[0]}")
    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def shard_tp(tensor: torch.Tensor, dim: int | None, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This TP rank's contiguous slice of ``tensor`` along ``dim``.

    ``dim`` is 0 for column-parallel weights/biases and vocab-parallel embeddings/output
    layers, 1 for row-parallel weights, ``None`` for replicated tensors (norms), which are
    returned unchanged. Raises ValueError when the dimension is not divisible by tp_size.
    """
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    if dim is None or tp_size == 1:
        return tensor
    _check_divisible(tensor.shape[dim], tp_size, f"dim {dim} of a tensor {tuple(tensor.shape)}")
    return torch.chunk(tensor, tp_size, dim=dim)[tp_rank].contiguous()


def gather_tp(shards: Sequence[torch.Tensor], dim: int | None) -> torch.Tensor:
    """Inverse of :func:`shard_tp`: concatenate the per-rank shards (index = TP rank)."""
    if not shards:
        raise ValueError("gather_tp: no shards")
    if dim is None or len(shards) == 1:
        return shards[0]
    return torch.cat(list(shards), dim=dim)


def pad_vocab(tensor: torch.Tensor, padded_vocab_size: int) -> torch.Tensor:
    """Append zero rows so ``tensor [vocab, hidden]`` becomes ``[padded_vocab_size, hidden]``.

    Zero rows give padded tokens a logit of exactly 0; they are removed on export.
    """
    vocab = tensor.shape[0]
    if padded_vocab_size < vocab:
        raise ValueError(f"pad_vocab: padded size {padded_vocab_size} < vocab size {vocab}")
    if padded_vocab_size == vocab:
        return tensor
    pad = tensor.new_zeros((padded_vocab_size - vocab, *tensor.shape[1:]))
    return torch.cat([tensor, pad], dim=0)


def unpad_vocab(tensor: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drop padding rows: ``[padded_vocab, hidden]`` -> ``[vocab_size, hidden]``."""
    if tensor.shape[0] < vocab_size:
        raise ValueError(f"unpad_vocab: tensor has {tensor.shape[0]} rows < vocab {vocab_size}")
    return tensor[:vocab_size].contiguous()


def kv_replication_factor(num_kv_heads: int, num_heads: int, tp_size: int) -> int:
    """How many times each KV head is replicated so that ``tp_size`` ranks can split them.

    megatron-core requires ``num_query_groups % tp == 0``. With ``tp > num_kv_heads`` the
    model is still representable when ``tp % num_kv_heads == 0`` and
    ``num_heads % tp == 0``: each KV head is copied ``tp / num_kv_heads`` times and every
    copy serves ``num_heads / tp`` query heads (the usual Megatron-LM treatment).

    Returns:
        1 when no replication is needed, otherwise ``tp // num_kv_heads``.

    Raises:
        ValueError: naming the head counts when no layout exists.
    """
    if num_heads % tp_size != 0:
        raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor "
                         f"parallel size tp={tp_size}")
    if num_kv_heads % tp_size == 0:
        return 1
    if tp_size % num_kv_heads == 0:
        return tp_size // num_kv_heads
    raise ValueError(f"num_key_value_heads={num_kv_heads} and tp={tp_size}: neither divides "
                     "the other, so the KV heads cannot be split or replicated across TP ranks")


def replicate_kv_heads(kv: torch.Tensor, *, num_kv_heads: int, head_dim: int,
                       factor: int) -> torch.Tensor:
    """``[num_kv_heads * head_dim, ...]`` -> ``[num_kv_heads * factor * head_dim, ...]``,
    each head repeated ``factor`` times consecutively (head g -> g*factor .. g*factor+f-1)."""
    if factor == 1:
        return kv
    tail = kv.shape[1:]
    grouped = kv.reshape(num_kv_heads, 1, head_dim, *tail)
    return grouped.expand(num_kv_heads, factor, head_dim, *tail).reshape(-1, *tail).contiguous()


def deduplicate_kv_heads(kv: torch.Tensor, *, num_kv_heads: int, head_dim: int,
                         factor: int) -> torch.Tensor:
    """Inverse of :func:`replicate_kv_heads`.

    Identical replicas (conversion round trip) give back the original tensor bit-exactly.
    Replicas that drifted apart (each trained on its own TP rank) are averaged, which is
    the closest single KV head in the least-squares sense.
    """
    if factor == 1:
        return kv
    tail = kv.shape[1:]
    grouped = kv.reshape(num_kv_heads, factor, head_dim, *tail)
    first = grouped[:, 0]
    if torch.equal(grouped, first.unsqueeze(1).expand_as(grouped)):
        return first.reshape(-1, *tail).contiguous()
    return grouped.mean(dim=1).reshape(-1, *tail).contiguous()


def megatron_qkv_to_vllm(qkv_shard: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> torch.Tensor:
    """Reorder one TP rank's Megatron ``linear_qkv`` shard into vLLM's ``qkv_proj`` shard.

    Args:
        qkv_shard: ``[(num_heads + 2 * num_kv_heads) * head_dim, ...]``, Megatron layout
            (per local KV group: q heads, k, v).
        num_heads, num_kv_heads: *local* counts on this rank (global / tp).

    Returns:
        Same shape, vLLM layout: all local q heads, then all local k, then all local v.
    """
    q, k, v = split_qkv(qkv_shard, num_heads=num_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim)
    return torch.cat([q, k, v], dim=0)


def vllm_qkv_to_megatron(qkv_shard: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> torch.Tensor:
    """Inverse of :func:`megatron_qkv_to_vllm` (local head counts)."""
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if qkv_shard.shape[0] != rows:
        raise ValueError(f"vllm_qkv_to_megatron: {qkv_shard.shape[0]} rows, expected {rows}")
    q, k, v = torch.split(qkv_shard, [num_heads * head_dim, num_kv_heads * head_dim,
                                      num_kv_heads * head_dim], dim=0)
    return fuse_qkv(q, k, v, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)


__all__ = [
    "fuse_qkv", "split_qkv", "fuse_gate_up", "split_gate_up", "shard_tp", "gather_tp",
    "pad_vocab", "unpad_vocab", "kv_replication_factor", "replicate_kv_heads",
    "deduplicate_kv_heads", "megatron_qkv_to_vllm", "vllm_qkv_to_megatron",
]
