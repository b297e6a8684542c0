"""LoRA test helpers: random Megatron-named adapters for a transformers model and the hand-merged reference.

The reference merge is computed in Megatron layout, ``W + (alpha / rank) B A`` on the Megatron base weight (LoRA,
Hu et al. 2021, eq. 3), and brought back to HF names with megaflow's existing base-weight conversion
(:func:`megaflow.models.hf_mapping.megatron_shards_to_hf`, the function the HF export applies to every row). It
never calls :mod:`megaflow.models.peft_io`, so it checks that module independently.
"""
from __future__ import annotations

import torch

from megaflow.models.hf_mapping import (
    ModelSpec,
    ShardLayout,
    find_mapping,
    hf_names,
    hf_to_megatron_shard,
    megatron_shards_to_hf,
)

ALL_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
_PARENT = {"linear_qkv": "self_attention", "linear_proj": "self_attention", "linear_fc1": "mlp", "linear_fc2": "mlp"}


def spec_of(model) -> ModelSpec:
    return ModelSpec.from_hf_config(model.config.to_dict())


def megatron_base(model, layer: int, target: str):
    """``(row, megatron weight [out, in])`` of one LoRA target of ``model`` (TP = 1 layout)."""
    spec = spec_of(model)
    row, _ = find_mapping(f"decoder.layers.{layer}.{_PARENT[target]}.{target}.weight", spec)
    state = model.state_dict()
    return row, hf_to_megatron_shard(row, [state[n] for n in hf_names(row, spec, layer)], spec, ShardLayout())


def random_adapter(model, rank: int, seed: int, targets=ALL_TARGETS, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """A full Megatron adapter dict with random A and B (B non-zero) for every layer and target."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for layer in range(model.config.num_hidden_layers):
        for target in targets:
            _, weight = megatron_base(model, layer, target)
            path = f"decoder.layers.{layer}.{_PARENT[target]}.{target}"
            out[path + ".lora_a.weight"] = torch.randn(rank, weight.shape[1], generator=gen) * scale
            out[path + ".lora_b.weight"] = torch.randn(weight.shape[0], rank, generator=gen) * scale
    return out


@torch.no_grad()
def merged_hf_state_dict(model, adapter: dict[str, torch.Tensor], *, rank: int,
                         alpha: float) -> dict[str, torch.Tensor]:
    """``model``'s HF state dict with ``W + (alpha / rank) B A`` merged into every adapted layer (Megatron layout)."""
    spec = spec_of(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for name in adapter:
        if not name.endswith(".lora_a.weight"):
            continue
        path = name.removesuffix(".lora_a.weight")
        layer, target = int(path.split(".")[2]), path.rsplit(".", 1)[-1]
        row, weight = megatron_base(model, layer, target)
        merged = weight + (alpha / rank) * (adapter[path + ".lora_b.weight"] @ adapter[name])
        for hf_name, tensor in zip(hf_names(row, spec, layer), megatron_shards_to_hf(row, [merged], spec),
                                   strict=True):
            state[hf_name] = tensor
    return state
