"""The one declarative table between Hugging Face and megatron-core GPTModel parameters.

Supported families: Llama (Llama 2/3, SmolLM2: ``LlamaForCausalLM``), Qwen2/Qwen2.5
(``Qwen2ForCausalLM``), Qwen3 dense (``Qwen3ForCausalLM``, q/k norms) and Qwen3-MoE
(``Qwen3MoeForCausalLM``: router ``mlp.gate`` and per-expert ``mlp.experts.{e}.*`` tensors,
the checkpoints' on-disk layout), plus their ``*ForSequenceClassification`` variants for critic and
reward models (``score.weight`` <-> megaflow's scalar ``output_layer``). Each row of :data:`PARAM_MAPPINGS` names the
megatron-core
parameter (with its aliases: the local layer spec keeps separate norms, the Transformer
Engine spec fuses them into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``),
its HF source tensors, the named transform that joins them and the tensor-parallel
partition dimension. :func:`hf_to_megatron_shard` and :func:`megatron_shards_to_hf` apply a
row in either direction for one TP rank / all TP ranks; they are pure and used by the
weight loader and the exporter (:mod:`megaflow.models.weights`, and through it the
conversion tools); the HybridEngine reads the rows themselves (:func:`find_mapping`) to
name the vLLM tensors. The architecture
they take (:class:`ModelSpec`, :data:`SUPPORTED_ARCHITECTURES`, :class:`UnsupportedModelError`)
is megaflow's one HF-config reader, :mod:`megaflow.topology.model_spec`, re-exported here.

``{layer}`` in a name is the *global* layer index on the HF side and the *local* index of
the pipeline stage (or virtual chunk) on the Megatron side; callers pass both.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import megaflow.models.transforms as T
from megaflow.topology.model_spec import SUPPORTED_ARCHITECTURES, ModelSpec, UnsupportedModelError

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
SCORE = "score.weight"


@dataclass(frozen=True)
class ParamMapping:
    """One row of the table.

    Attributes:
        megatron: megatron-core names, first = local layer spec, then aliases (TE spec).
        hf: HF source names, in the order the transform takes them.
        transform: ``"copy"``, ``"qkv"`` (fuse per KV group), ``"gate_up"`` (SwiGLU fc1) or
            ``"vocab"`` (pad rows to the padded vocabulary).
        tp_dim: partition dim of the HF tensors and the Megatron shard; None = replicated.
        stage: ``"layer"`` (names contain ``{layer}``), ``"expert"`` (names contain
            ``{layer}`` and ``{expert}``: one row per expert, local index on the Megatron
            side, global on the HF side), ``"first"`` (lives on the first
            pipeline stage: embedding) or ``"last"`` (final norm, output layer).
        requires: the row exists only for models with QKV bias (``"qkv_bias"``), with q/k
            norms (``"qk_norm"``), with a dense MLP (``"dense_mlp"``), with experts
            (``"moe"``), with an
            LM head (``"lm_head"``) or with a scalar value/reward head (``"score"``).
        tied_hf: when embeddings are tied, the HF name read instead of ``hf`` (and on
            export the row is skipped: the tied HF model has no such tensor).
    """

    megatron: tuple[str, ...]
    hf: tuple[str, ...]
    transform: str = "copy"
    tp_dim: int | None = None
    stage: str = "layer"
    requires: str | None = None
    tied_hf: str | None = None

    @property
    def per_layer(self) -> bool:
        return self.stage in ("layer", "expert")

    @property
    def per_expert(self) -> bool:
        return self.stage == "expert"


_L = "decoder.layers.{layer}."
_H = "model.layers.{layer}."
_E = _L + "mlp.experts.local_experts.{expert}."
_HE = _H + "mlp.experts.{expert}."
PARAM_MAPPINGS: tuple[ParamMapping, ...] = (
    ParamMapping(("embedding.word_embeddings.weight",), (EMBED,), "vocab", 0, stage="first"),
    ParamMapping((_L + "input_layernorm.weight", _L + "self_attention.linear_qkv.layer_norm_weight"),
                 (_H + "input_layernorm.weight",)),
    ParamMapping((_L + "self_attention.linear_qkv.weight",),
                 tuple(_H + f"self_attn.{p}_proj.weight" for p in "qkv"), "qkv", 0),
    ParamMapping((_L + "self_attention.linear_qkv.bias",),
                 tuple(_H + f"self_attn.{p}_proj.bias" for p in "qkv"), "qkv", 0,
                 requires="qkv_bias"),
    # Qwen3: RMSNorm over head_dim on each query / key head, replicated across TP.
    ParamMapping((_L + "self_attention.q_layernorm.weight",), (_H + "self_attn.q_norm.weight",), requires="qk_norm"),
    ParamMapping((_L + "self_attention.k_layernorm.weight",), (_H + "self_attn.k_norm.weight",), requires="qk_norm"),
    ParamMapping((_L + "self_attention.linear_proj.weight",), (_H + "self_attn.o_proj.weight",),
                 "copy", 1),
    ParamMapping((_L + "pre_mlp_layernorm.weight", _L + "mlp.linear_fc1.layer_norm_weight"),
                 (_H + "post_attention_layernorm.weight",)),
    ParamMapping((_L + "mlp.linear_fc1.weight",),
                 (_H + "mlp.gate_proj.weight", _H + "mlp.up_proj.weight"), "gate_up", 0, requires="dense_mlp"),
    ParamMapping((_L + "mlp.linear_fc2.weight",), (_H + "mlp.down_proj.weight",), "copy", 1,
                 requires="dense_mlp"),
    # Mixture of experts (Qwen3-MoE): the router, replicated on every rank, and each expert's
    # SwiGLU MLP (megatron-core SequentialMLP; the expert's rank holds it whole at TP=1).
    ParamMapping((_L + "mlp.router.weight",), (_H + "mlp.gate.weight",), requires="moe"),
    ParamMapping((_E + "linear_fc1.weight",), (_HE + "gate_proj.weight", _HE + "up_proj.weight"), "gate_up", 0,
                 stage="expert", requires="moe"),
    ParamMapping((_E + "linear_fc2.weight",), (_HE + "down_proj.weight",), "copy", 1, stage="expert",
                 requires="moe"),
    ParamMapping(("decoder.final_layernorm.weight",), ("model.norm.weight",), stage="last"),
    ParamMapping(("output_layer.weight",), (LM_HEAD,), "vocab", 0, stage="last",
                 requires="lm_head", tied_hf=EMBED),
    # megaflow.megatron.model.ScalarHead, replicated on every TP rank.
    ParamMapping(("output_layer.weight",), (SCORE,), stage="last", requires="score"),
)


def _compile(template: str) -> re.Pattern:
    pattern = re.escape(template)
    for field in ("layer", "expert"):
        pattern = pattern.replace(re.escape("{" + field + "}"), r"(\d+)")
    return re.compile(pattern + "$")


_MEGATRON_PATTERNS = [(_compile(name), row) for row in PARAM_MAPPINGS for name in row.megatron]


def find_mapping(megatron_name: str, spec: ModelSpec) -> tuple[ParamMapping, int | None]:
    """Look up a megatron-core state-dict name among the rows active for ``spec``.

    Returns:
        The row and the local layer index in the name (None for non-layer rows).

    Raises:
        KeyError: the name is not in the table (e.g. an unknown module).
    """
    for pattern, row in _MEGATRON_PATTERNS:
        match = pattern.match(megatron_name)
        if match and is_active(row, spec):
            return row, int(match.group(1)) if row.per_layer else None
    raise KeyError(f"megatron parameter {megatron_name!r} has no HF mapping for a "
                   f"{spec.model_type} model with a {spec.head!r} head")


def is_active(row: ParamMapping, spec: ModelSpec) -> bool:
    """Whether the row exists for this model (QKV bias only for Qwen2, q/k norms only for
    Qwen3; one head kind)."""
    if row.requires == "qkv_bias":
        return spec.qkv_bias
    if row.requires == "qk_norm":
        return spec.qk_norm
    if row.requires in ("moe", "dense_mlp"):
        return spec.is_moe == (row.requires == "moe")
    return row.requires is None or row.requires == spec.head


def local_expert(megatron_name: str, row: ParamMapping) -> int | None:
    """The local expert index in a Megatron name of an expert row (None for other rows)."""
    if not row.per_expert:
        return None
    for name in row.megatron:
        match = _compile(name).match(megatron_name)
        if match:
            return int(match.group(2))
    raise KeyError(f"{megatron_name!r} is not a name of row {row.megatron[0]!r}")


def hf_names(row: ParamMapping, spec: ModelSpec, layer: int | None = None,
             expert: int | None = None) -> tuple[str, ...]:
    """HF names read for ``row`` at global ``layer`` (and global ``expert`` for expert rows;
    tied output layer -> embedding)."""
    names = (row.tied_hf,) if row.tied_hf and spec.tie_word_embeddings else row.hf
    return tuple(n.format(layer=layer, expert=expert) for n in names)


def exported_rows(spec: ModelSpec) -> list[ParamMapping]:
    """Rows that produce HF tensors on export (tied output layer and absent biases skipped)."""
    return [r for r in PARAM_MAPPINGS
            if is_active(r, spec) and not (r.tied_hf and spec.tie_word_embeddings)]


def hf_order(spec: ModelSpec) -> list[tuple[ParamMapping, int | None]]:
    """The exported ``(row, global layer)`` units in HF's order: embedding, layers, norm,
    head. Expert rows appear once per layer (:func:`hf_units` expands them per expert)."""
    rows = exported_rows(spec)
    units: list[tuple[ParamMapping, int | None]] = [(r, None) for r in rows if r.stage == "first"]
    units += [(r, i) for i in range(spec.num_layers) for r in rows if r.per_layer]
    return units + [(r, None) for r in rows if r.stage == "last"]


def hf_units(spec: ModelSpec) -> list[tuple[ParamMapping, int | None, int | None]]:
    """:func:`hf_order` with expert rows expanded: ``(row, global layer, global expert)``,
    expert None for non-expert rows."""
    return [(row, layer, expert) for row, layer in hf_order(spec)
            for expert in (range(spec.num_experts) if row.per_expert else (None,))]


def expected_hf_keys(spec: ModelSpec) -> list[str]:
    """Every HF tensor name of the model, in HF's order."""
    return [name for row, layer, expert in hf_units(spec) for name in hf_names(row, spec, layer, expert)]


def hf_shape(name: str, spec: ModelSpec) -> tuple[int, ...]:
    """The expected shape of HF tensor ``name`` (used to validate checkpoints exactly)."""
    h, d = spec.hidden_size, spec.head_dim
    leaf = re.sub(r"^model\.layers\.\d+\.", "", re.sub(r"\.experts\.\d+\.", ".experts.", name))
    shapes = {
        EMBED: (spec.vocab_size, h), LM_HEAD: (spec.vocab_size, h), SCORE: (1, h),
        "model.norm.weight": (h,),
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (spec.num_attention_heads * d, h),
        "self_attn.k_proj.weight": (spec.num_key_value_heads * d, h),
        "self_attn.v_proj.weight": (spec.num_key_value_heads * d, h),
        "self_attn.q_proj.bias": (spec.num_attention_heads * d,),
        "self_attn.k_proj.bias": (spec.num_key_value_heads * d,),
        "self_attn.v_proj.bias": (spec.num_key_value_heads * d,),
        "self_attn.o_proj.weight": (h, spec.num_attention_heads * d),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (spec.ffn_hidden_size, h),
        "mlp.up_proj.weight": (spec.ffn_hidden_size, h),
        "mlp.down_proj.weight": (h, spec.ffn_hidden_size),
        "mlp.gate.weight": (spec.num_experts, h),
        "mlp.experts.gate_proj.weight": (spec.moe_ffn_hidden_size, h),
        "mlp.experts.up_proj.weight": (spec.moe_ffn_hidden_size, h),
        "mlp.experts.down_proj.weight": (h, spec.moe_ffn_hidden_size),
    }
    if leaf not in shapes:
        raise KeyError(f"unknown HF tensor name {name!r}")
    return shapes[leaf]


@dataclass(frozen=True)
class ShardLayout:
    """How the Megatron side is laid out: TP size/rank, padded vocab, KV replication."""

    tp_size: int = 1
    tp_rank: int = 0
    padded_vocab_size: int | None = None  # None: no padding
    kv_replication: int = 1


def hf_to_megatron_shard(row: ParamMapping, hf_tensors: Sequence[torch.Tensor],
                         spec: ModelSpec, layout: ShardLayout) -> torch.Tensor:
    """Build this TP rank's Megatron tensor for ``row`` from the full HF tensors.

    Args:
        hf_tensors: full (unsharded) HF tensors in the order of :func:`hf_names`.

    Returns:
        The local shard, e.g. ``linear_qkv [(H + 2 K r) d / tp, hidden]`` with r the KV
        replication factor.
    """
    tp, rank = layout.tp_size, layout.tp_rank
    if row.transform == "qkv":
        q, k, v = hf_tensors
        num_kv = spec.num_key_value_heads * layout.kv_replication
        if spec.num_attention_heads % tp or num_kv % tp:
            raise ValueError(f"tp={tp} does not divide num_attention_heads={spec.num_attention_heads} and "
                             f"num_key_value_heads={spec.num_key_value_heads} x kv_replication="
                             f"{layout.kv_replication} (see transforms.kv_replication_factor)")
        k, v = (T.replicate_kv_heads(t, num_kv_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
                                     factor=layout.kv_replication) for t in (k, v))
        q, k, v = (T.shard_tp(t, 0, tp, rank) for t in (q, k, v))
        return T.fuse_qkv(q, k, v, num_heads=spec.num_attention_heads // tp, num_kv_heads=num_kv // tp,
                          head_dim=spec.head_dim)
    if row.transform == "gate_up":
        gate, up = (T.shard_tp(t, 0, tp, rank) for t in hf_tensors)
        return T.fuse_gate_up(gate, up)
    (tensor,) = hf_tensors
    if row.transform == "vocab" and layout.padded_vocab_size is not None:
        tensor = T.pad_vocab(tensor, layout.padded_vocab_size)
    return T.shard_tp(tensor, row.tp_dim, tp, rank)


def megatron_shards_to_hf(row: ParamMapping, shards: Sequence[torch.Tensor], spec: ModelSpec,
                          kv_replication: int = 1) -> list[torch.Tensor]:
    """Inverse of :func:`hf_to_megatron_shard` for all TP ranks at once.

    Args:
        shards: the Megatron tensors of every TP rank, index = TP rank.

    Returns:
        The full HF tensors in the order of ``row.hf`` (vocabulary padding removed).
    """
    tp = len(shards)
    if row.transform == "qkv":
        num_kv = spec.num_key_value_heads * kv_replication
        parts = [T.split_qkv(s, num_heads=spec.num_attention_heads // tp, num_kv_heads=num_kv // tp,
                             head_dim=spec.head_dim) for s in shards]
        q, k, v = (T.gather_tp([p[i] for p in parts], 0) for i in range(3))
        k, v = (T.deduplicate_kv_heads(t, num_kv_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
                                       factor=kv_replication) for t in (k, v))
        return [q, k, v]
    if row.transform == "gate_up":
        halves = [T.split_gate_up(s) for s in shards]
        return [T.gather_tp([h[0] for h in halves], 0), T.gather_tp([h[1] for h in halves], 0)]
    full = T.gather_tp(shards, row.tp_dim)
    if row.transform == "vocab":
        full = T.unpad_vocab(full, spec.vocab_size)
    return [full]


__all__ = [
    "SUPPORTED_ARCHITECTURES", "EMBED", "LM_HEAD", "SCORE", "UnsupportedModelError", "ModelSpec",
    "ParamMapping", "PARAM_MAPPINGS", "ShardLayout", "find_mapping", "is_active", "hf_names", "exported_rows",
    "hf_order", "hf_units", "local_expert", "expected_hf_keys", "hf_shape", "hf_to_megatron_shard",
    "megatron_shards_to_hf",
]
