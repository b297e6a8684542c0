"""What a LoRA config implies for a model (pure sizes; the adapters themselves are
:mod:`megaflow.megatron.lora`): the full sizes of the linears LoRA can target and the
adapters' parameter count, for the load-time checks and the memory planner."""
from __future__ import annotations

from collections.abc import Sequence

from megaflow.topology.model_spec import ModelSpec


def lora_layer_dims(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    """``{target: (in_features, out_features)}`` of the full (unsharded) Megatron linears of
    one dense layer: QKV ``(h, (heads + 2 kv) d)``, proj ``(heads d, h)``, fc1 ``(h, 2 ffn)``
    (SwiGLU gate and up) and fc2 ``(ffn, h)``."""
    h, d = spec.hidden_size, spec.head_dim
    return {"linear_qkv": (h, (spec.num_attention_heads + 2 * spec.num_key_value_heads) * d),
            "linear_proj": (spec.num_attention_heads * d, h),
            "linear_fc1": (h, 2 * spec.ffn_hidden_size),
            "linear_fc2": (spec.ffn_hidden_size, h)}


def lora_adapter_numel(spec: ModelSpec, rank: int, target_modules: Sequence[str]) -> int:
    """Adapter parameters of the whole model: ``rank * (in + out)`` per targeted linear and
    layer (0 when ``rank`` is 0)."""
    dims = lora_layer_dims(spec)
    return spec.num_layers * sum(rank * sum(dims[t]) for t in target_modules)


def lora_rank_adapter_numel(spec: ModelSpec, rank: int, target_modules: Sequence[str], *, tp: int, pp: int) -> int:
    """Adapter parameters on one rank of a ``tp`` x ``pp`` mesh (a stage of ``num_layers / pp``
    layers): column-parallel targets hold ``A`` ``[r, in]`` (replicated) and ``B`` ``[out / tp, r]``,
    row-parallel ones ``A`` ``[r, in / tp]`` and ``B`` ``[out, r]`` (replicated)."""
    dims, per_layer = lora_layer_dims(spec), 0
    for target in target_modules:
        in_f, out_f = dims[target]
        per_layer += rank * (in_f + out_f // tp) if target in ("linear_qkv", "linear_fc1") \
            else rank * (in_f // tp + out_f)
    return -(-spec.num_layers // pp) * per_layer


def lora_rank_adapted_weight_numel(spec: ModelSpec, target_modules: Sequence[str], *, tp: int, pp: int) -> int:
    """Elements of the adapted base weights ``W`` on one rank of a ``tp`` x ``pp`` mesh: ``in * out / tp``
    per targeted linear and layer of a stage of ``num_layers / pp`` layers (what the merged weight
    sync replaces by ``W + (alpha / r) B A``, computed into new tensors; 0 without targets)."""
    dims = lora_layer_dims(spec)
    return -(-spec.num_layers // pp) * sum(dims[t][0] * dims[t][1] // tp for t in target_modules)


__all__ = ["lora_layer_dims", "lora_adapter_numel", "lora_rank_adapter_numel", "lora_rank_adapted_weight_numel"]
