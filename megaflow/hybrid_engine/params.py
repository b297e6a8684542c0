"""How the HybridEngine reads a rank's named parameters: TP partitioning and global names.

Pure helpers (no process groups). Names are megatron-core ``GPTModel`` names as
``model.named_parameters()`` returns them on one pipeline stage, e.g.
``decoder.layers.3.self_attention.linear_qkv.weight`` with *local* layer indices;
wrapper prefixes (``module.`` from DDP / Float16Module) are stripped.

TP partitioning is read from megatron's parameter attributes (``tensor_model_parallel``,
``partition_dim``, ``partition_stride``) when present, otherwise from the name table
below (so plain tensors named like a GPTModel work too):

==========================================  ======  =================================
name                                        dim     stride
==========================================  ======  =================================
``embedding.word_embeddings.weight``        0       1 (vocab-parallel)
``output_layer.weight``                     0       1 (vocab-parallel)
``*.self_attention.linear_qkv.{weight,bias}``  0    1 (whole KV groups per rank)
``*.self_attention.linear_proj.weight``     1       1 (row-parallel)
``*.mlp.linear_fc1.{weight,bias}``          0       2 if gated (``[gate; up]`` per rank)
``*.mlp.linear_fc2.weight``                 1       1 (row-parallel)
``*.mlp.experts.local_experts.{e}.linear_fc1.weight``  0  2 if gated (expert TP)
``*.mlp.experts.local_experts.{e}.linear_fc2.weight``  1  1 (expert TP, row-parallel)
anything else (norms, router, biases)       --      replicated
==========================================  ======  =================================
"""
from __future__ import annotations

import dataclasses
import re

import torch

__all__ = ["LocalParam", "strip_wrapper_prefix", "partition_of", "local_layer_index", "local_expert_index",
           "with_expert_index",
           "to_global_name", "count_local_layers", "describe_local_params"]

_RULES: tuple[tuple[re.Pattern, int, bool], ...] = (
    (re.compile(r"(^|\.)embedding\.word_embeddings\.weight$"), 0, False),
    (re.compile(r"(^|\.)output_layer\.weight$"), 0, False),
    (re.compile(r"\.self_attention\.linear_qkv\.(weight|bias)$"), 0, False),
    (re.compile(r"\.self_attention\.linear_proj\.weight$"), 1, False),
    (re.compile(r"\.mlp\.linear_fc1\.(weight|bias)$"), 0, True),
    (re.compile(r"\.mlp\.linear_fc2\.weight$"), 1, False),
    (re.compile(r"\.mlp\.experts\.local_experts\.\d+\.linear_fc1\.weight$"), 0, True),
    (re.compile(r"\.mlp\.experts\.local_experts\.\d+\.linear_fc2\.weight$"), 1, False),
)
_EXPERT = re.compile(r"^(.*\.mlp\.experts\.local_experts\.)(\d+)(\..+)$")
_LAYER = re.compile(r"^(decoder\.layers\.)(\d+)(\..+)$")
_WRAPPER = "module."


@dataclasses.dataclass(frozen=True)
class LocalParam:
    """Metadata of one parameter on one rank (picklable; exchanged between ranks).

    ``shard_shape`` is this rank's training shard; ``full_shape`` the unsharded tensor.
    """

    name: str                       # global megatron name (layer index renamed)
    local_name: str                 # key in the rank's named-parameter dict
    shard_shape: tuple[int, ...]
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    partition_dim: int | None    # None: replicated across TP
    stride: int

    @property
    def shard_numel(self) -> int:
        n = 1
        for s in self.shard_shape:
            n *= s
        return n

    @property
    def shard_nbytes(self) -> int:
        return self.shard_numel * torch.empty((), dtype=self.dtype).element_size()


def local_expert_index(name: str) -> int | None:
    """The local expert index in a megatron-core SequentialMLP expert parameter name
    (``...mlp.experts.local_experts.{e}...``), None for any other parameter."""
    match = _EXPERT.match(name)
    return int(match.group(2)) if match else None


def with_expert_index(name: str, expert: int) -> str:
    """``name`` with its expert index replaced by ``expert`` (local -> global numbering).

    Raises:
        ValueError: ``name`` is not an expert parameter.
    """
    match = _EXPERT.match(name)
    if not match:
        raise ValueError(f"{name!r} is not a mixture-of-experts expert parameter")
    return f"{match.group(1)}{expert}{match.group(3)}"


def strip_wrapper_prefix(name: str) -> str:
    """``module.module.decoder.x`` -> ``decoder.x`` (DDP / Float16Module wrappers)."""
    while name.startswith(_WRAPPER):
        name = name[len(_WRAPPER):]
    return name


def partition_of(name: str, tensor: torch.Tensor, *, gated_linear_unit: bool) -> tuple[int | None, int]:
    """``(partition_dim, stride)`` of a parameter; ``(None, 1)`` when replicated.

    Megatron's attributes win when present. Raises ValueError when they contradict the
    name table for a known name (a fused layout the resharder would get wrong) or when a
    TP-partitioned parameter has no ``partition_dim``.
    """
    name = strip_wrapper_prefix(name)
    by_name: tuple[int | None, int] = (None, 1)
    for pattern, dim, gated in _RULES:
        if pattern.search(name):
            by_name = (dim, 2 if gated and gated_linear_unit else 1)
            break
    if not hasattr(tensor, "tensor_model_parallel"):
        return by_name
    if not tensor.tensor_model_parallel:
        return None, 1
    attr_dim = getattr(tensor, "partition_dim", None)
    if attr_dim is None or attr_dim < 0:
        raise ValueError(f"{name}: tensor_model_parallel=True but partition_dim={attr_dim!r}")
    by_attr = (int(attr_dim), int(getattr(tensor, "partition_stride", 1)))
    if by_name[0] is not None and by_attr != by_name:
        raise ValueError(f"{name}: megatron attributes say (partition_dim, stride)={by_attr} "
                         f"but megaflow's table says {by_name} (gated_linear_unit="
                         f"{gated_linear_unit}); refusing to guess the fused layout")
    return by_attr


def local_layer_index(name: str) -> int | None:
    """Local transformer layer index in a stage's parameter name, None outside layers."""
    match = _LAYER.match(strip_wrapper_prefix(name))
    return int(match.group(2)) if match else None


def to_global_name(name: str, layer_offset: int) -> str:
    """Strip wrappers and rename ``decoder.layers.{i}`` to ``decoder.layers.{i+offset}``."""
    name = strip_wrapper_prefix(name)
    match = _LAYER.match(name)
    if not match:
        return name
    return f"{match.group(1)}{int(match.group(2)) + layer_offset}{match.group(3)}"


def count_local_layers(names) -> int:
    """Number of transformer layers on a stage, from its local ``decoder.layers.{i}`` names.

    Raises:
        ValueError: when the local indices are not exactly ``0 .. n-1``.
    """
    indices = {i for i in map(local_layer_index, names) if i is not None}
    if indices and indices != set(range(max(indices) + 1)):
        raise ValueError(f"local layer indices {sorted(indices)} are not 0..n-1: pass the "
                         "stage's own named_parameters() (megatron numbers layers per stage)")
    return len(indices)


def describe_local_params(named_params, *, tp: int, layer_offset: int,
                          gated_linear_unit: bool) -> list[LocalParam]:
    """:class:`LocalParam` for every entry of ``named_params`` (name -> tensor), in order.

    Raises:
        TypeError: a value is not a tensor.
        ValueError: a partitioned dimension not divisible by the stride, or two names
            mapping to the same global name.
    """
    out, seen = [], set()
    for local_name, tensor in named_params.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"parameter {local_name!r} is a {type(tensor).__name__}, not a tensor")
        dim, stride = partition_of(local_name, tensor, gated_linear_unit=gated_linear_unit)
        shape = tuple(tensor.shape)
        full = list(shape)
        if dim is not None:
            if shape[dim] % stride:
                raise ValueError(f"{local_name}: dim {dim} of shape {shape} is not divisible "
                                 f"by its stride {stride}")
            full[dim] *= tp
        name = to_global_name(local_name, layer_offset)
        if name in seen:
            raise ValueError(f"two parameters map to the global name {name!r}")
        seen.add(name)
        out.append(LocalParam(name=name, local_name=local_name, shard_shape=shape,
                              full_shape=tuple(full), dtype=tensor.dtype, partition_dim=dim,
                              stride=stride))
    return out
