"""Model architecture facts the planner needs, read from an HF config without weights.

:func:`resolve_hf_config` finds the HF config of a role (inline ``hf_config`` dict or the
checkpoint's ``config.json``); :func:`model_spec` turns it into a :class:`ModelSpec`;
:func:`count_parameters` and :func:`stage_parameters` count parameters by formula
(checked against ``transformers`` models in the tests). Pure Python: no torch import.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from megaflow.config.typed import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
#: Architecture fields that must agree between an inline hf_config and path/config.json.
ARCH_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size", "tie_word_embeddings")


@dataclass(frozen=True)
class ModelSpec:
    """A Llama/Qwen2-family decoder: sizes and bias/tying flags.

    ``source`` is the dotted config key the facts came from (for error messages).
    """

    model_type: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    source: str


def _read_config_json(path: str, key: str) -> dict[str, Any]:
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise ConfigError(key, f"no config.json in {file.parent}; point it to an HF checkpoint directory "
                               "or set the inline hf_config next to it")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(key, f"{file} is not valid JSON: {err}") from None


def resolve_hf_config(path: str | None, inline: Mapping[str, Any] | None, prefix: str) -> tuple[Mapping[str, Any], str]:
    """The HF config of the section at ``prefix`` (``"model"``, ``"reward_model"``).

    Returns ``(config, source_key)``: the inline ``<prefix>.hf_config`` when set (checked
    against ``<path>/config.json`` when that file exists), else ``<path>/config.json``.

    Raises:
        ConfigError: neither is set, config.json is missing/invalid, or the two disagree
            on an architecture field (the key names the field).
    """
    if inline is not None:
        if path is not None and (Path(path).expanduser() / "config.json").is_file():
            on_disk = _read_config_json(path, f"{prefix}.path")
            for name in ARCH_FIELDS:
                if name in inline and name in on_disk and inline[name] != on_disk[name]:
                    raise ConfigError(f"{prefix}.hf_config.{name}",
                                      f"{inline[name]!r} disagrees with {on_disk[name]!r} in {path}/config.json")
        return inline, f"{prefix}.hf_config"
    if path is None:
        raise ConfigError(f"{prefix}.path", "set {0} (an HF checkpoint directory) or {1} (an inline HF config)",
                          (f"{prefix}.path", f"{prefix}.hf_config"))
    return _read_config_json(path, f"{prefix}.path"), f"{prefix}.path"


def _field_error(source: str, name: str, detail: str) -> ConfigError:
    """Error about HF config field ``name``: keyed ``<source>.<name>`` for an inline
    hf_config, ``<source>`` (the path key) for a config.json."""
    if source.endswith(".hf_config"):
        return ConfigError(f"{source}.{name}", detail)
    return ConfigError(source, f"config.json field {name!r}: {detail}")


def _int_field(cfg: Mapping[str, Any], name: str, source: str, default: Any = None) -> int:
    value = cfg.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _field_error(source, name, "missing" if value is None else f"must be a positive int, got {value!r}")
    return value


def model_spec(cfg: Mapping[str, Any], source: str = "model.hf_config") -> ModelSpec:
    """Parse a Llama/Qwen2 HF config into a :class:`ModelSpec`.

    Defaults follow ``transformers``: ``num_key_value_heads`` = heads, ``head_dim`` =
    hidden / heads, ``tie_word_embeddings`` false, Llama's ``attention_bias`` (q, k, v, o)
    and ``mlp_bias`` false; Qwen2 always has q/k/v biases and no o/MLP bias.

    Raises:
        ConfigError: unsupported ``model_type``, mixture-of-experts fields, or a missing /
            non-positive size (the key names the field).
    """
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _field_error(source, "model_type",
                           f"{model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    for moe_key in ("num_local_experts", "num_experts"):
        if cfg.get(moe_key):
            raise _field_error(source, moe_key, "mixture-of-experts models are not supported")
    hidden = _int_field(cfg, "hidden_size", source)
    heads = _int_field(cfg, "num_attention_heads", source)
    if cfg.get("head_dim") is None and hidden % heads:
        raise _field_error(source, "hidden_size", f"{hidden} is not divisible by num_attention_heads={heads} "
                                                  "(set head_dim explicitly)")
    head_dim = cfg.get("head_dim") or hidden // heads
    is_qwen2 = model_type == "qwen2"
    return ModelSpec(
        model_type=model_type,
        num_layers=_int_field(cfg, "num_hidden_layers", source),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=_int_field(cfg, "num_key_value_heads", source, default=heads),
        head_dim=_int_field({"head_dim": head_dim}, "head_dim", source),
        ffn_hidden_size=_int_field(cfg, "intermediate_size", source),
        vocab_size=_int_field(cfg, "vocab_size", source),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or bool(cfg.get("attention_bias", False)),
        o_bias=not is_qwen2 and bool(cfg.get("attention_bias", False)),
        mlp_bias=not is_qwen2 and bool(cfg.get("mlp_bias", False)),
        source=source,
    )


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the next multiple of ``divisible_by * tp``.

    Same rule as megatron-core's ``make_vocab_size_divisible_by`` (and
    ``megaflow.megatron.model.padded_vocab_size``), kept here so that planning needs no
    torch/megatron import.
    """
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class LayerParameters:
    """Parameters of one transformer layer, split by how TP shards them.

    ``sharded`` is divided by the TP size (QKV/O/MLP weights, column-parallel biases);
    ``replicated`` is held whole on every TP rank (norms, row-parallel biases).
    """

    sharded: int
    replicated: int

    @property
    def total(self) -> int:
        return self.sharded + self.replicated


def layer_parameters(spec: ModelSpec) -> LayerParameters:
    """Parameters of one decoder layer.

    Attention: ``h*(a + 2*g)*d`` for Q, K, V and ``a*d*h`` for O (``a`` heads, ``g`` KV
    heads, ``d`` head_dim), biases ``(a + 2*g)*d`` (+``h`` for O); SwiGLU MLP
    ``3*h*f`` (+``2*f + h`` biases); two RMSNorm weights ``2*h``.
    """
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    qkv_out = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * d
    sharded = h * qkv_out + spec.num_attention_heads * d * h + 3 * h * f
    sharded += qkv_out if spec.qkv_bias else 0
    sharded += 2 * f if spec.mlp_bias else 0
    replicated = 2 * h + (h if spec.o_bias else 0) + (h if spec.mlp_bias else 0)
    return LayerParameters(sharded=sharded, replicated=replicated)


def count_parameters(spec: ModelSpec, head: str = "lm") -> int:
    """Total unique parameters, unpadded vocabulary, as ``transformers`` counts them.

    Args:
        spec: the architecture.
        head: ``"lm"`` (vocabulary projection, shared with the embedding when tied) or
            ``"value"`` (critic / reward model: a ``hidden -> 1`` scalar head).
    """
    embedding = spec.vocab_size * spec.hidden_size
    if head == "lm":
        out = 0 if spec.tie_word_embeddings else embedding
    else:
        out = spec.hidden_size
    return embedding + spec.num_layers * layer_parameters(spec).total + spec.hidden_size + out


def stage_parameters(spec: ModelSpec, tp: int, pp: int, head: str = "lm") -> tuple[int, ...]:
    """Parameters held by one rank of each pipeline stage at ``tp`` x ``pp``.

    Megatron's layout: stage 0 holds the (TP-sharded, padded) embedding, the last stage
    the final norm and the output layer; with tied embeddings and ``pp > 1`` the last
    stage keeps its own copy of the embedding for the output. Layers are split evenly.

    Returns:
        One count per stage (index = pipeline rank).
    """
    vocab = padded_vocab_size(spec.vocab_size, tp)
    layer = layer_parameters(spec)
    per_layer = -(-layer.sharded // tp) + layer.replicated
    layers_per_stage = spec.num_layers // pp
    embedding = vocab * spec.hidden_size // tp
    if head == "lm":
        output = 0 if (spec.tie_word_embeddings and pp == 1) else embedding
    else:
        output = spec.hidden_size
    counts = []
    for stage in range(pp):
        n = layers_per_stage * per_layer
        n += embedding if stage == 0 else 0
        n += spec.hidden_size + output if stage == pp - 1 else 0
        counts.append(n)
    return tuple(counts)
