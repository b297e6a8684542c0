"""Fill a built megatron-core GPTModel shard from HF weights, and gather it back to HF.

Works on the model chunks of one rank as built by
:func:`megaflow.megatron.model.build_gpt_model` (local or Transformer Engine layer spec,
any TP/PP, uneven pipeline stages, a list of virtual-pipeline chunks). Pipeline-local
layer numbers are mapped to global ones through each layer's ``layer_number`` (Megatron's
1-based global index), so no layer offset arithmetic is repeated here. Mixture-of-experts
models: each expert-parallel rank loads its own experts (:func:`global_expert`), and the
export gathers every expert through EP rank 0 of the writer's expert group.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megaflow.models.hf_io import CheckpointError, HFWeights
from megaflow.models.hf_mapping import (
    SCORE,
    ModelSpec,
    ParamMapping,
    ShardLayout,
    find_mapping,
    hf_names,
    hf_shape,
    hf_to_megatron_shard,
    hf_units,
    local_expert,
    megatron_shards_to_hf,
)

if TYPE_CHECKING:  # megatron-core has no type information: GPTModel reads as Any
    from megatron.core.models.gpt import GPTModel

log = logging.getLogger(__name__)


def unwrap_model_chunks(model_chunks: Any) -> list[GPTModel]:
    """A model or list of chunks -> list of bare GPTModels (DDP/Float16Module unwrapped)."""
    chunks = list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    unwrapped = []
    for chunk in chunks:
        while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
            chunk = chunk.module  # Megatron DDP / Float16Module wrappers
        unwrapped.append(chunk)
    return unwrapped


def _global_layers(chunk: GPTModel) -> list[int]:
    """Global 0-based layer index of each local layer of ``chunk``."""
    return [layer.layer_number - 1 for layer in chunk.decoder.layers]


def _has_scalar_head(chunk: GPTModel, spec: ModelSpec) -> bool:
    head = getattr(chunk, "output_layer", None)
    weight = getattr(head, "weight", None)
    return weight is not None and tuple(weight.shape) == (1, spec.hidden_size)


def model_spec_for(chunks: Sequence[GPTModel], spec: ModelSpec) -> ModelSpec:
    """``spec`` with ``head`` set to what these chunks have (critic/reward: ``score``).

    Only the last pipeline stage holds the head: on other stages this answers
    ``lm_head``, which is harmless for loading (their parameters do not depend on it);
    export agrees on the head over the PP group instead (:func:`plan_export`).
    """
    scalar = any(_has_scalar_head(c, spec) for c in chunks)
    return dataclasses.replace(spec, head="score" if scalar else "lm_head",
                               tie_word_embeddings=spec.tie_word_embeddings and not scalar)


def shard_layout(chunk: GPTModel, spec: ModelSpec, tp_size: int, tp_rank: int) -> ShardLayout:
    """The :class:`ShardLayout` of a built chunk: padded vocab and KV-head replication."""
    num_query_groups = chunk.config.num_query_groups or chunk.config.num_attention_heads
    if num_query_groups % spec.num_kv_heads:
        raise ValueError(f"model has num_query_groups={num_query_groups}, not a multiple of the "
                         f"checkpoint's num_key_value_heads={spec.num_kv_heads}")
    return ShardLayout(tp_size=tp_size, tp_rank=tp_rank, padded_vocab_size=chunk.vocab_size,
                       kv_replication=num_query_groups // spec.num_kv_heads)


def _ep(parallel_info: Any) -> tuple[int, int]:
    """``(ep_rank, ep_size)`` of a ParallelInfo (1 when it predates expert parallelism)."""
    return getattr(parallel_info, "ep_rank", 0), getattr(parallel_info, "ep_size", 1)


def global_expert(local: int, spec: ModelSpec, parallel_info: Any) -> int:
    """Global index of local expert ``local``: megatron-core gives EP rank r the contiguous
    experts ``[r * E / ep, (r + 1) * E / ep)`` (``MoELayer.local_expert_indices``)."""
    ep_rank, ep_size = _ep(parallel_info)
    return ep_rank * (spec.num_experts // ep_size) + local


def _named_params(chunk: GPTModel) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in chunk.named_parameters() if p is not None]


def load_hf_weights(model_chunks: Any, hf_source: str | os.PathLike | Mapping[str, torch.Tensor] | HFWeights,
                    hf_config: Any, parallel_info: Any, *, progress: bool = False) -> int:
    """Copy HF weights into this rank's TP shard / PP stage of a built GPTModel.

    Args:
        model_chunks: a GPTModel or a list of chunks (optionally DDP-wrapped).
        hf_source: HF checkpoint directory (safetensors), a ``name -> tensor`` mapping, or
            an :class:`HFWeights`.
        hf_config: the checkpoint's ``PretrainedConfig`` or ``config.json`` dict.
        parallel_info: :class:`megaflow.megatron.parallel.ParallelInfo` (``tp_rank``,
            ``tp_size``).
        progress: show a tqdm bar (pass True on one rank only).

    Returns:
        Number of parameters filled. Every parameter of the model is filled, except a
        scalar head (critic/reward) when the checkpoint is a causal LM: it keeps its
        initialisation and the checkpoint's ``lm_head`` is unused.

    Raises:
        CheckpointError: the checkpoint's key set or shapes do not match its config
            (missing/extra/wrong keys are listed), a file is truncated, or a model
            parameter has no HF source or an unexpected shape (named).
        UnsupportedModelError / ValueError: unsupported architecture or config feature.
    """
    chunks = unwrap_model_chunks(model_chunks)
    ckpt_spec = ModelSpec.from_hf_config(hf_config)
    weights = hf_source if isinstance(hf_source, HFWeights) else HFWeights(hf_source)
    weights.validate(ckpt_spec)
    spec = model_spec_for(chunks, ckpt_spec)
    holds_head = any(getattr(c, "post_process", True) for c in chunks)  # last PP stage
    if holds_head and spec.head == "lm_head" and ckpt_spec.head == "score":
        raise CheckpointError("the HF checkpoint is a sequence-classification model (score "
                              "head) but the model to fill has an LM head")
    work = [(chunk, shard_layout(chunk, spec, parallel_info.tp_size, parallel_info.tp_rank),
             name, param) for chunk in chunks for name, param in _named_params(chunk)]
    bar = _progress(len(work), "loading HF weights", progress)
    filled = 0
    for chunk, layout, name, param in work:
        try:
            row, local = find_mapping(name, spec)
        except KeyError as err:
            raise CheckpointError(str(err)) from None
        layer = None if local is None else _global_layers(chunk)[local]
        expert = local_expert(name, row)
        expert = None if expert is None else global_expert(expert, spec, parallel_info)
        sources = hf_names(row, spec, layer, expert)
        bar.update(1)
        if sources == (SCORE,) and SCORE not in weights:
            log.info("%s: the checkpoint has no %s; the scalar head keeps its initialisation",
                     name, SCORE)
            continue
        shard = hf_to_megatron_shard(row, [weights.get(s) for s in sources], spec, layout)
        if shard.shape != param.shape:
            raise CheckpointError(f"{name}: built {tuple(shard.shape)} from {list(sources)}, "
                                  f"but the model parameter is {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(shard.to(param.dtype))
        filled += 1
    bar.close()
    return filled


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled)


@dataclasses.dataclass(frozen=True)
class ExportPlan:
    """What :func:`iter_hf_tensors` gathers: the model's spec (with the head kind that only
    the last stage can see) and which PP rank holds each global layer."""

    spec: ModelSpec
    layer_owner: dict[int, int]


def plan_export(model_chunks: Any, hf_config: Any, parallel_info: Any) -> ExportPlan:
    """Agree on the :class:`ExportPlan` over the PP group (collective: one
    ``all_gather_object``; data-parallel replicas other than 0 skip it and get a local plan).

    Raises:
        CheckpointError: some global layer is held by no stage.
    """
    chunks = unwrap_model_chunks(model_chunks)
    spec, info = ModelSpec.from_hf_config(hf_config), parallel_info
    mine = (sorted({g for chunk in chunks for g in _global_layers(chunk)}),
            any(_has_scalar_head(c, spec) for c in chunks))
    per_stage: list[Any] = [mine]
    writer_group = info.dp_rank == 0 or getattr(info, "expert_dp_rank", 0) == 0  # + its EP group
    if info.pp_size > 1 and writer_group and info.cp_rank == 0:
        per_stage = [None] * info.pp_size
        dist.all_gather_object(per_stage, mine, group=info.pp_group)
    owners = {g: pp for pp, (layers, _) in enumerate(per_stage) for g in layers}
    missing = sorted(set(range(spec.num_layers)) - set(owners))
    if missing and len(per_stage) == info.pp_size:
        raise CheckpointError(f"no pipeline stage holds layers {missing}")
    scalar = any(has_scalar for _, has_scalar in per_stage)
    spec = dataclasses.replace(spec, head="score" if scalar else "lm_head",
                               tie_word_embeddings=spec.tie_word_embeddings and not scalar)
    return ExportPlan(spec, owners)


def _owner(row: ParamMapping, layer: int | None, owners: dict[int, int], pp_size: int) -> int:
    """The pipeline stage holding ``row`` at global ``layer`` (None for the rows of the
    first and last stage, which are not per layer: :func:`~megaflow.models.hf_mapping.hf_order`)."""
    if layer is not None:
        return owners[layer]
    return 0 if row.stage == "first" else pp_size - 1


def _local_param(chunks: Sequence[GPTModel], row: ParamMapping,
                 layer: int | None, expert: int | None = None) -> torch.Tensor:
    """This stage's parameter for ``row`` at global ``layer`` (any layer-spec alias), and
    for expert rows local ``expert``."""
    for chunk in chunks:
        params = dict(_named_params(chunk))
        names = list(row.megatron)
        if row.per_layer:
            local_layers = _global_layers(chunk)
            if layer not in local_layers:
                continue
            names = [n.format(layer=local_layers.index(layer), expert=expert) for n in names]
        for name in names:
            if name in params:
                return params[name].detach()
    raise CheckpointError(f"this pipeline stage holds no parameter {row.megatron[0]!r} "
                          f"(global layer {layer})")


def iter_hf_tensors(model_chunks: Any, hf_config: Any, parallel_info: Any, *,
                    dtype: torch.dtype | None = None, plan: ExportPlan | None = None
                    ) -> Iterator[tuple[str, torch.Tensor | None]]:
    """Gather the model into full HF tensors, one at a time (collective).

    Every rank of the model must iterate the generator to the end, in lockstep. Only the
    writer rank (:func:`is_export_writer`: tp, pp, dp and cp rank 0) receives tensors; the
    others get ``(name, None)``. Data-parallel replicas other than dp_rank 0 skip all
    communication. Per tensor: an all-gather over the owning stage's TP group, the
    inverse transform on its TP rank 0, and a send to PP stage 0 when the owner is
    another stage. Peak extra memory on the writer: one full tensor and its TP shards.

    Args:
        hf_config: the HF config the model was built from.
        dtype: cast the exported tensors (default: the model's parameter dtype).
        plan: from :func:`plan_export` (computed here when None).

    Yields:
        ``(hf_name, tensor [hf shape] or None)`` in HF order (embedding, layers, norm,
        head); a tied model yields no ``lm_head.weight``, a critic / reward model yields
        ``score.weight``; vocabulary padding is removed; replicated KV heads are folded back.
    """
    chunks = unwrap_model_chunks(model_chunks)
    info = parallel_info
    plan = plan or plan_export(chunks, hf_config, info)
    spec, active = plan.spec, info.dp_rank == 0 and info.cp_rank == 0
    # Expert rows: the EP group of the writer (expert-DP rank 0) takes part as well.
    active_experts = getattr(info, "expert_dp_rank", 0) == 0
    model_param = next(p for c in chunks for _, p in _named_params(c))
    kv_replication = shard_layout(chunks[0], spec, info.tp_size, 0).kv_replication
    for row, layer, expert in hf_units(spec):
        names = hf_names(row, spec, layer, expert)
        tensors: Sequence[torch.Tensor | None] = [None] * len(names)
        if active_experts if row.per_expert else active:
            owner = _owner(row, layer, plan.layer_owner, info.pp_size)
            tensors = _gather_row(chunks, row, layer, owner, spec, info, kv_replication,
                                  model_param, expert) or tensors
        for name, tensor in zip(names, tensors, strict=True):
            yield name, None if tensor is None else tensor.to(dtype or model_param.dtype)


def _gather_row(chunks: Sequence[GPTModel], row: ParamMapping, layer: int | None, owner: int, spec: ModelSpec,
                info: Any, kv_replication: int, like: torch.Tensor,
                expert: int | None = None) -> list[torch.Tensor] | None:
    """Full HF tensors of one row (global ``expert`` for expert rows) on the writer; None
    on every other rank."""
    full = None
    ep_rank, ep_size = _ep(info)
    per_rank = spec.num_experts // ep_size if row.per_expert else 0
    holder = expert // per_rank if expert is not None else 0  # the EP rank holding the expert (expert rows)
    if info.pp_rank == owner and ep_rank == holder:
        local = _local_param(chunks, row, layer, None if expert is None else expert % per_rank).contiguous()
        shards = [local]
        if row.tp_dim is not None and info.tp_size > 1:
            shards = [torch.empty_like(local) for _ in range(info.tp_size)]
            dist.all_gather(shards, local, group=info.tp_group)
        if info.tp_rank == 0:
            full = megatron_shards_to_hf(row, shards, spec, kv_replication)
    names = hf_names(row, spec, layer, expert)
    if row.per_expert and holder != 0 and info.tp_rank == 0 and info.pp_rank == owner:
        full = _expert_to_ep_rank0(full, names, spec, info, holder, like)
    if info.tp_rank != 0 or ep_rank != 0 or (info.pp_rank != 0 and info.pp_rank != owner):
        return None
    if owner == 0:
        return full
    if info.pp_rank == owner:
        assert full is not None  # (this stage's TP rank 0 gathered the row, EP rank 0 received it above)
        for tensor in full:
            dist.send(tensor.contiguous(), dst=info.pp_ranks[0])
        return None
    received = [torch.empty(hf_shape(n, spec), dtype=like.dtype, device=like.device) for n in names]
    for buf in received:
        dist.recv(buf, src=info.pp_ranks[owner])
    return received


def _expert_to_ep_rank0(full: list[torch.Tensor] | None, names: Sequence[str], spec: ModelSpec, info: Any,
                        holder: int, like: torch.Tensor) -> list[torch.Tensor] | None:
    """Send an expert's full HF tensors from EP rank ``holder`` to EP rank 0 of the same
    stage and TP rank 0; returns them on EP rank 0, None elsewhere."""
    ranks = dist.get_process_group_ranks(info.ep_group)
    if info.ep_rank == holder:
        assert full is not None  # (the holder's TP rank 0 gathered the expert's tensors)
        for tensor in full:
            dist.send(tensor.contiguous(), dst=ranks[0])
        return None
    if info.ep_rank != 0:
        return None
    received = [torch.empty(hf_shape(n, spec), dtype=like.dtype, device=like.device) for n in names]
    for buf in received:
        dist.recv(buf, src=ranks[holder])
    return received


def is_export_writer(parallel_info: Any) -> bool:
    """Whether this rank receives the tensors of :func:`iter_hf_tensors`."""
    i = parallel_info
    return i.tp_rank == 0 and i.pp_rank == 0 and i.dp_rank == 0 and i.cp_rank == 0


def gather_hf_state_dict(model_chunks: Any, hf_config: Any, parallel_info: Any,
                         *, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor] | None:
    """The whole model as an HF state dict on the writer rank, None elsewhere (collective).

    Holds every tensor in memory: for large models stream with :func:`iter_hf_tensors`.
    Tensors are on CPU.
    """
    out = {name: t.cpu() for name, t in iter_hf_tensors(model_chunks, hf_config, parallel_info,
                                                         dtype=dtype) if t is not None}
    return out if is_export_writer(parallel_info) else None


__all__ = ["load_hf_weights", "iter_hf_tensors", "gather_hf_state_dict", "is_export_writer",
           "model_spec_for", "shard_layout", "unwrap_model_chunks", "plan_export", "global_expert",
           "ExportPlan"]
