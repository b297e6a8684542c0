"""Per-rank memory of the streamed weight sync (pure arithmetic, no process groups).

The sync (:func:`megaflow.hybrid_engine.rollout_weights.generation_buckets` loaded by
:func:`megaflow.hybrid_engine.transport.load_buckets`) first wakes the engine's weights,
then gathers, converts and loads the generation shard one tensor at a time, handing out a
bucket before the next tensor is gathered. At any moment a rank holds

* its training shard (the actor's parameters, never moved by the streamed route),
* the engine's weights (re-allocated by the wake, before anything is gathered),
* one bucket of converted tensors (at most ``bucket_bytes``; a single larger tensor forms
  a bucket of its own; never more than the engine's weights), and
* the generation tensor in conversion (its gathered buffer, or a regrouped copy of it
  while the buffer is freed, or the Megatron vocabulary rows while vLLM's are exchanged).

So the peak is ``actor shard + engine weights + min(max(bucket, largest), engine) +
largest``, where ``largest`` is the largest generation tensor (TP = t_g shard); this is
the planner's "weight sync" phase, and what ``tools/bench_reshard.py`` and
``tools/bench_memory.py`` measure with their live-tensor accounts. The old route (gather
the whole generation shard, then wake the engine) held ``actor + generation shard +
engine + vocabulary all-gather + bucket`` instead (issue 31: 72.5 GiB for the 70B recipe).
"""
from __future__ import annotations

from dataclasses import dataclass

from megaflow.topology.model_spec import ModelSpec, padded_vocab_size

#: vLLM pads its embedding and LM head to a multiple of this many rows
#: (``vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE``).
VLLM_VOCAB_PADDING = 64

__all__ = ["VLLM_VOCAB_PADDING", "WeightSyncMemory", "weight_sync_peak_bytes", "largest_generation_tensor_bytes",
           "weight_sync_memory"]


def weight_sync_peak_bytes(*, actor_shard: float, engine_weights: float, bucket_bytes: float,
                           largest_tensor: float) -> float:
    """Peak bytes per rank of the streamed weight sync (see the module docstring).

    Args:
        actor_shard: the rank's training parameters (bytes).
        engine_weights: the rollout engine's weights on this rank (bytes).
        bucket_bytes: ``rollout.weight_sync_bucket_mb`` in bytes.
        largest_tensor: the largest tensor of the generation shard (bytes).

    Returns:
        ``actor_shard + engine_weights + min(max(bucket_bytes, largest_tensor),
        engine_weights) + largest_tensor``.

    Raises:
        ValueError: a negative size, or a non-positive bucket.
    """
    if min(actor_shard, engine_weights, largest_tensor) < 0 or bucket_bytes <= 0:
        raise ValueError(f"weight_sync_peak_bytes: sizes must be >= 0 and the bucket > 0, got actor_shard="
                         f"{actor_shard}, engine_weights={engine_weights}, bucket_bytes={bucket_bytes}, "
                         f"largest_tensor={largest_tensor}")
    bucket = min(max(bucket_bytes, largest_tensor), engine_weights)
    return actor_shard + engine_weights + bucket + largest_tensor


def largest_generation_tensor_bytes(spec: ModelSpec, *, train_tp: int, gen_tp: int, dtype_bytes: int) -> int:
    """Bytes of the largest tensor of a generation shard (TP = ``gen_tp``, megatron-core layouts).

    The candidates: the vocabulary rows (embedding / output layer, padded for the training
    TP as the resharder gathers them, ``padded_vocab(V, t) / t_g * hidden``, or vLLM's
    rows where its padding to :data:`VLLM_VOCAB_PADDING` is larger), ``linear_qkv``
    (``(heads + 2 * kv_heads) * head_dim / t_g`` rows, a KV head replicated when
    ``t_g > kv_heads``), ``linear_proj``, ``linear_fc1`` (``2 * ffn / t_g`` rows) and
    ``linear_fc2``. For a mixture-of-experts model the MLP candidate is instead what one layer's
    experts hold while vLLM's fused parameters are assembled
    (:class:`~megaflow.hybrid_engine.rollout_weights.ExpertStacks`): the ``w13`` and ``w2``
    stacks of all ``E`` experts, ``3 * E * moe_ffn / t_g * hidden``, plus the expert ``fc1``
    being converted, ``2 * moe_ffn / t_g * hidden``.
    """
    h, d = spec.hidden_size, spec.head_dim
    rows_q = spec.num_attention_heads * d // gen_tp
    rows_kv = 2 * max(1, spec.num_key_value_heads // gen_tp) * d
    vocab_rows = max(padded_vocab_size(spec.vocab_size, train_tp), -(-spec.vocab_size // VLLM_VOCAB_PADDING)
                     * VLLM_VOCAB_PADDING) // gen_tp
    if spec.is_moe:
        expert_ffn = spec.moe_ffn_hidden_size // gen_tp
        mlp: tuple[int, ...] = ((3 * spec.num_experts + 2) * expert_ffn * h,)
    else:
        mlp = (2 * spec.ffn_hidden_size // gen_tp * h, h * spec.ffn_hidden_size // gen_tp)
    numels = (vocab_rows * h, (rows_q + rows_kv) * h, h * rows_q, *mlp)
    return max(numels) * dtype_bytes


@dataclass(frozen=True)
class WeightSyncMemory:
    """The weight sync's per-rank terms (bytes); ``peak`` by :func:`weight_sync_peak_bytes`."""

    actor_shard: float
    engine_weights: float
    bucket: float
    largest_tensor: float

    @property
    def peak(self) -> float:
        return weight_sync_peak_bytes(actor_shard=self.actor_shard, engine_weights=self.engine_weights,
                                      bucket_bytes=self.bucket, largest_tensor=self.largest_tensor)

    def parts(self) -> tuple[tuple[str, float], ...]:
        """``(label, bytes)`` of the four terms as the peak counts them."""
        bucket = self.peak - self.actor_shard - self.engine_weights - self.largest_tensor
        return (("actor params", self.actor_shard), ("rollout engine weights", self.engine_weights),
                ("weight-sync bucket", bucket), ("largest generation tensor", self.largest_tensor))


def weight_sync_memory(spec: ModelSpec, *, actor_shard: float, engine_weights: float, bucket_mb: int, train_tp: int,
                       gen_tp: int, dtype_bytes: int) -> WeightSyncMemory:
    """:class:`WeightSyncMemory` of a plan (``bucket_mb``: ``rollout.weight_sync_bucket_mb``)."""
    return WeightSyncMemory(actor_shard=actor_shard, engine_weights=engine_weights, bucket=float(bucket_mb << 20),
                            largest_tensor=float(largest_generation_tensor_bytes(
                                spec, train_tp=train_tp, gen_tp=gen_tp, dtype_bytes=dtype_bytes)))
