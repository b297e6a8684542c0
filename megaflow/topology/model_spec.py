"""The one reader of Hugging Face ``config.json`` architectures, and parameter counts by formula.

:func:`resolve_hf_config` finds the HF config of a role (inline ``hf_config`` dict or the
checkpoint's ``config.json``); :func:`model_spec` validates it and turns it into a
:class:`ModelSpec`. The planner (:mod:`megaflow.topology.sizes`), the model builder
(:mod:`megaflow.megatron.model`) and the weight mapping (:mod:`megaflow.models.hf_mapping`)
all read architectures through it, so a config the planner accepts builds in the workers,
and a feature megaflow cannot build is refused once, at load, naming the field and file.
:func:`count_parameters` and :func:`stage_parameters` count parameters by formula
(checked against ``transformers`` models in the tests). Pure Python: no torch import.
"""
from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megaflow.config.typed import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
#: HF architecture -> (model_type, head): ``lm_head`` for causal LMs, ``score`` for
#: sequence-classification models (critic / reward model: megaflow's scalar head).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "lm_head"), "Qwen2ForCausalLM": ("qwen2", "lm_head"),
    "LlamaForSequenceClassification": ("llama", "score"),
    "Qwen2ForSequenceClassification": ("qwen2", "score"),
    "Qwen3ForCausalLM": ("qwen3", "lm_head"), "Qwen3ForSequenceClassification": ("qwen3", "score"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "lm_head"),
}
#: Families with an RMSNorm over ``head_dim`` on every query and key head before RoPE
#: (HF ``q_norm`` / ``k_norm``; megatron-core's ``qk_layernorm``).
QK_NORM_MODEL_TYPES = ("qwen3", "qwen3_moe")
#: Families whose every layer's MLP is a mixture of experts (top-k softmax router, SwiGLU
#: experts, no shared experts): Qwen3-MoE.
MOE_MODEL_TYPES = ("qwen3_moe",)
#: Architecture fields that must agree between an inline hf_config and path/config.json.
ARCH_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "intermediate_size", "vocab_size", "tie_word_embeddings")
#: Values ``transformers`` fills in for fields a config.json omits (the keyword defaults of
#: ``LlamaConfig`` / ``Qwen2Config`` / ``Qwen3Config`` in transformers 5; the tests compare
#: them with those classes). ``None`` for ``num_key_value_heads``: the number of attention
#: heads; ``head_dim`` absent: ``hidden_size / num_attention_heads``.
HF_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-6, "initializer_range": 0.02, "attention_dropout": 0.0, "rope_theta": 10000.0},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "initializer_range": 0.02, "attention_dropout": 0.0, "rope_theta": 10000.0},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "initializer_range": 0.02, "attention_dropout": 0.0, "rope_theta": 10000.0},
    "qwen3_moe": {"vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
                  "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 32768,
                  "rms_norm_eps": 1e-6, "initializer_range": 0.02, "attention_dropout": 0.0, "rope_theta": 10000.0,
                  "num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "norm_topk_prob": False},
}
#: Mixture-of-experts fields: refused on the dense families (an MoE config under a dense
#: ``model_type`` is not a model megaflow knows how to build).
MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
#: megatron-core's ``RotaryEmbedding._apply_scaling`` hard-codes these llama3 RoPE parameters.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


class UnsupportedModelError(ConfigError):
    """The HF config describes an architecture megaflow cannot build (a :class:`ConfigError`,
    hence a ``ValueError``); ``key`` names the field, the message the file or config key."""


@dataclass(frozen=True)
class ModelSpec:
    """A Llama/Qwen2/Qwen3-family decoder as megaflow builds it, read from an HF config.

    Sizes use HF's names where HF has one (``num_attention_heads``, ``num_key_value_heads``,
    ``head_dim``, ``vocab_size`` unpadded); ``ffn_hidden_size`` is HF ``intermediate_size``
    and ``num_layers`` HF ``num_hidden_layers`` (megatron-core's names). ``qkv_bias``: biases
    on q/k/v (Qwen2), never on o_proj or the MLP. RoPE: base ``rope_theta``; llama3 scaling
    factor (megatron ``rope_scaling_factor``) or linear interpolation factor (megatron
    ``seq_len_interpolation_factor``), None when unscaled. ``qk_norm``: an RMSNorm over
    ``head_dim`` on each query and key head before RoPE (Qwen3). ``head`` is ``"lm_head"`` (causal
    LM; absent from the checkpoint when ``tie_word_embeddings``) or ``"score"`` (a
    ``[num_labels=1, hidden]`` value/reward head, never tied). ``source`` is the dotted
    config key the facts came from (for error messages).

    Mixture of experts (Qwen3-MoE; ``num_experts == 0`` for dense models): every layer's MLP
    is ``num_experts`` SwiGLU experts of width ``moe_ffn_hidden_size`` (HF
    ``moe_intermediate_size``) and a bias-free linear router ``[num_experts, hidden]``
    choosing ``moe_topk`` (HF ``num_experts_per_tok``) experts per token from a softmax over
    all experts; ``moe_norm_topk_prob`` (HF ``norm_topk_prob``) renormalises the chosen
    probabilities to sum to 1. ``ffn_hidden_size`` is then HF ``intermediate_size``, which
    such a model does not use.
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
    norm_eps: float
    rope_theta: float
    rope_scaling_factor: float | None
    rope_interpolation_factor: float | None
    max_position_embeddings: int
    attention_dropout: float
    initializer_range: float
    head: str = "lm_head"
    source: str = "hf_config"
    qk_norm: bool = False
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = False

    @property
    def is_moe(self) -> bool:
        """Whether the MLPs are mixtures of experts."""
        return self.num_experts > 0

    @classmethod
    def from_hf_config(cls, hf_config: Any, source: str = "hf_config") -> ModelSpec:
        """:func:`model_spec` (the weight mapping's and the workers' spelling)."""
        return model_spec(hf_config, source)

    # The weight mapping and the resharding code call the head counts by these shorter names.
    @property
    def num_heads(self) -> int:
        """``num_attention_heads``."""
        return self.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        """``num_key_value_heads``."""
        return self.num_key_value_heads


def _read_config_json(path: str, key: str) -> dict[str, Any]:
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise ConfigError(key, f"no config.json in {file.parent}; point it to an HF checkpoint directory "
                               "or set the inline hf_config next to it")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(key, f"{file} is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise ConfigError(key, f"{file} holds a JSON {type(config).__name__}, not an object of config fields")
    return config


def resolve_hf_config(path: str | None, inline: Mapping[str, Any] | None, prefix: str) -> tuple[Mapping[str, Any], str]:
    """The HF config of the section at ``prefix`` (``"model"``, ``"reward_model"``).

    Returns ``(config, source_key)``: the inline ``<prefix>.hf_config`` when set (checked
    against ``<path>/config.json`` when that file exists), else ``<path>/config.json``
    (source ``<prefix>.path``). The workers build from ``config.json`` whenever the path
    has one, so that file is also read by :func:`model_spec` here: a feature it cannot
    build is refused at load although the inline config omits it.

    Raises:
        ConfigError: neither is set, config.json is missing/invalid, the two disagree on
            an architecture field (the key names the field), or config.json describes an
            architecture megaflow cannot build (:class:`UnsupportedModelError`).
    """
    if inline is not None:
        if path is not None and (Path(path).expanduser() / "config.json").is_file():
            on_disk = _read_config_json(path, f"{prefix}.path")
            for name in ARCH_FIELDS:
                if name in inline and name in on_disk and inline[name] != on_disk[name]:
                    raise ConfigError(f"{prefix}.hf_config.{name}",
                                      f"{inline[name]!r} disagrees with {on_disk[name]!r} in {path}/config.json")
            model_spec(on_disk, f"{prefix}.path")
        return inline, f"{prefix}.hf_config"
    if path is None:
        raise ConfigError(f"{prefix}.path", "set {0} (an HF checkpoint directory) or {1} (an inline HF config)",
                          (f"{prefix}.path", f"{prefix}.hf_config"))
    return _read_config_json(path, f"{prefix}.path"), f"{prefix}.path"


def _field_key_message(source: str, name: str, detail: str) -> tuple[str, str]:
    """Key and message of an error about HF config field ``name`` (dotted for nested fields):
    keyed ``<source>.<name>`` unless ``source`` is a checkpoint path key (``*.path``), whose
    config.json is then named in the message."""
    if source.endswith(".path"):
        return source, f"config.json field {name!r}: {detail}"
    return f"{source}.{name}", detail


def _field_error(source: str, name: str, detail: str) -> ConfigError:
    """Error about HF config field ``name``; see :func:`_field_key_message`."""
    return ConfigError(*_field_key_message(source, name, detail))


def _unsupported(source: str, name: str, detail: str) -> UnsupportedModelError:
    return UnsupportedModelError(*_field_key_message(source, name, detail))


def _int_field(value: Any, name: str, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _field_error(source, name, "missing" if value is None else f"must be a positive int, got {value!r}")
    return value


def _float_field(value: Any, name: str, source: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _field_error(source, name, f"must be a number, got {value!r}")
    return float(value)


def _positive_float(value: Any, name: str, source: str) -> float:
    number = _float_field(value, name, source)
    if not math.isfinite(number) or number <= 0:
        raise _field_error(source, name, f"must be a finite number > 0, got {value!r}")
    return number


def _bool_field(cfg: Mapping[str, Any], name: str, source: str, default: bool = False) -> bool:
    value = cfg.get(name, default)
    if not isinstance(value, bool):
        raise _field_error(source, name, f"must be true or false, got {value!r}")
    return value


#: Special-token fields of an HF config: each an id (``eos_token_id`` also a list of ids) or null.
TOKEN_ID_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def _check_token_ids(cfg: Mapping[str, Any], vocab_size: int, source: str) -> None:
    """Each of :data:`TOKEN_ID_FIELDS` is null or an id in ``[0, vocab_size)`` (a list of
    them for ``eos_token_id``): an id outside has no embedding row, and a negative one
    would stop nothing (``-1`` is not a token the model can emit)."""
    for name in TOKEN_ID_FIELDS:
        value = cfg.get(name)
        if value is None:
            continue
        ids = value if isinstance(value, (list, tuple)) and name == "eos_token_id" else [value]
        for token in ids:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
                raise _field_error(source, name, f"must be a token id in [0, vocab_size={vocab_size}) or null, "
                                                 f"got {value!r}")


def _as_mapping(hf_config: Any) -> Mapping[str, Any]:
    if isinstance(hf_config, Mapping):
        return hf_config
    to_dict = getattr(hf_config, "to_dict", None)
    if callable(to_dict):
        return to_dict()
    raise TypeError(f"hf_config must be a transformers.PretrainedConfig or a dict of config.json, "
                    f"got {type(hf_config).__name__}")


def _head(cfg: Mapping[str, Any], source: str) -> str:
    """``"score"`` for a ``*ForSequenceClassification`` architecture, else ``"lm_head"``."""
    archs = list(cfg.get("architectures") or [])
    heads: set[str] = set()
    for name in archs:
        entry = SUPPORTED_ARCHITECTURES.get(name)
        if entry is None or entry[0] != cfg.get("model_type"):
            raise _unsupported(source, "architectures",
                               f"{archs!r} (model_type={cfg.get('model_type')!r}) is not supported; "
                               f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}")
        heads.add(entry[1])
    if len(heads) > 1:
        raise _unsupported(source, "architectures", f"{archs!r} mixes an LM head and a score head")
    if "score" in heads and cfg.get("num_labels", 1) != 1:
        raise _unsupported(source, "num_labels", f"{cfg['num_labels']!r}: a value/reward head has exactly one output")
    return heads.pop() if heads else "lm_head"


def _refuse_unbuildable(cfg: Mapping[str, Any], model_type: str, source: str) -> None:
    """Raise :class:`UnsupportedModelError` for a field whose value megaflow's GPTModel
    (SwiGLU, RMSNorm, full causal attention, q/k/v bias only) cannot reproduce."""
    if model_type in MOE_MODEL_TYPES:
        _refuse_unbuildable_moe(cfg, source)
    else:
        for name in MOE_FIELDS:
            if cfg.get(name):
                raise _unsupported(source, name, f"{cfg[name]!r}: mixture-of-experts fields in a dense "
                                                 f"{model_type!r} config are not supported (MoE families: "
                                                 f"{', '.join(MOE_MODEL_TYPES)})")
    if cfg.get("use_sliding_window"):
        raise _unsupported(source, "use_sliding_window", "true: sliding-window attention is not supported")
    if model_type == "llama" and cfg.get("sliding_window") is not None:  # Qwen ignores it unless use_sliding_window
        raise _unsupported(source, "sliding_window", f"{cfg['sliding_window']!r}: sliding-window attention "
                                                     "is not supported")
    layer_types = cfg.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise _unsupported(source, "layer_types", f"{list(layer_types)!r}: only full_attention layers are supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise _unsupported(source, "hidden_act", f"{cfg['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    # Qwen2 has fixed biases: q/k/v on, o_proj and MLP off
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise _unsupported(source, "attention_bias", "true (bias on q/k/v and o_proj) is not supported; "
                                                     "megaflow builds q/k/v biases only (Qwen2)")
    if model_type == "llama" and cfg.get("mlp_bias"):
        raise _unsupported(source, "mlp_bias", "true is not supported (the MLP has no biases)")
    if cfg.get("quantization_config"):
        raise _unsupported(source, "quantization_config", "quantized checkpoints are not supported")


def _refuse_unbuildable_moe(cfg: Mapping[str, Any], source: str) -> None:
    """Qwen3-MoE fields megaflow's MoE layers (every layer sparse, no shared experts) cannot
    reproduce: dense layers in between (``decoder_sparse_step`` != 1, ``mlp_only_layers``)."""
    if cfg.get("decoder_sparse_step", 1) != 1:
        raise _unsupported(source, "decoder_sparse_step", f"{cfg['decoder_sparse_step']!r}: only 1 (every layer "
                                                          "a mixture of experts) is supported")
    if cfg.get("mlp_only_layers"):
        raise _unsupported(source, "mlp_only_layers", f"{list(cfg['mlp_only_layers'])!r}: dense layers in a "
                                                      "mixture-of-experts model are not supported")


def _moe_fields(cfg: Mapping[str, Any], model_type: str, source: str) -> dict[str, Any]:
    """The :class:`ModelSpec` MoE fields of a Qwen3-MoE config (empty for dense families)."""
    if model_type not in MOE_MODEL_TYPES:
        return {}
    defaults = HF_DEFAULTS[model_type]

    def size(name: str) -> int:
        return _int_field(cfg[name] if name in cfg else defaults[name], name, source)

    # transformers 5 writes num_local_experts (Qwen3MoeConfig.attribute_map); 4.x num_experts
    experts_key = "num_local_experts" if "num_local_experts" in cfg or "num_experts" not in cfg else "num_experts"
    experts, topk = size(experts_key), size("num_experts_per_tok")
    if topk > experts:
        raise _field_error(source, "num_experts_per_tok", f"{topk} exceeds {experts_key}={experts}")
    return {"num_experts": experts, "moe_topk": topk, "moe_ffn_hidden_size": size("moe_intermediate_size"),
            "moe_norm_topk_prob": bool(cfg.get("norm_topk_prob", defaults["norm_topk_prob"]))}


def _rope(cfg: Mapping[str, Any], default_theta: float, source: str) -> tuple[float, float | None, float | None]:
    """``(rope_theta, llama3 factor, linear factor)`` from transformers 5 ``rope_parameters``
    or transformers 4 ``rope_scaling`` + ``rope_theta``."""
    key = "rope_parameters" if cfg.get("rope_parameters") is not None else "rope_scaling"
    params = cfg.get(key) or {}
    if not isinstance(params, Mapping):
        raise _field_error(source, key, f"must be a mapping, got {params!r}")
    theta = _float_field(params.get("rope_theta", cfg.get("rope_theta", default_theta)), "rope_theta", source)
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise _unsupported(source, "partial_rotary_factor", f"{partial!r}: only full rotary embeddings are supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None, None
    if rope_type not in ("linear", "llama3"):
        raise _unsupported(source, f"{key}.rope_type", f"{rope_type!r} is not supported (supported: default, "
                                                      "linear, llama3)")
    if params.get("factor") is None:
        raise _field_error(source, f"{key}.factor", f"missing (required with rope_type {rope_type!r})")
    factor = _float_field(params["factor"], f"{key}.factor", source)
    if rope_type == "linear":
        return theta, None, factor
    for name, wanted in MEGATRON_LLAMA3_ROPE.items():
        if float(params.get(name, wanted)) != wanted:
            raise _unsupported(source, f"{key}.{name}", f"{params.get(name)!r}: megatron-core implements llama3 "
                                                        f"RoPE scaling only with {MEGATRON_LLAMA3_ROPE}")
    return theta, factor, None


def model_spec(hf_config: Any, source: str = "hf_config") -> ModelSpec:
    """Validate a Llama/Qwen2/Qwen3 HF config and read it into a :class:`ModelSpec`.

    The one architecture reader of megaflow (planner, model builder, weight mapping).
    Fields the config omits take ``transformers``' defaults for its ``model_type``
    (:data:`HF_DEFAULTS`); ``num_key_value_heads`` null means one KV head per attention
    head; ``head_dim`` defaults to ``hidden_size / num_attention_heads`` (``LlamaConfig``,
    ``Qwen2Attention``; Qwen3's default is 128). Llama and Qwen3 have q/k/v biases only with
    ``attention_bias`` (refused), Qwen2 always; Qwen3 has q/k norms.

    Args:
        hf_config: the dict of a ``config.json`` or a ``transformers.PretrainedConfig``.
        source: dotted config key the dict came from (``model.hf_config``; ``model.path``
            for a checkpoint's config.json), used in the errors and kept as ``spec.source``.

    Raises:
        UnsupportedModelError: (a :class:`ConfigError`) an architecture megaflow does not
            build: unknown ``model_type`` or ``architectures``, ``num_labels`` != 1 for a
            score head, mixture-of-experts fields in a dense family's config, Qwen3-MoE with
            dense layers (``decoder_sparse_step`` != 1, ``mlp_only_layers``), sliding-window or non-full attention
            layers, an activation other than SiLU, o_proj/MLP biases, quantization, partial
            rotary embeddings, RoPE scaling other than linear / megatron-core's llama3.
        ConfigError: a non-positive or non-integer size, ``hidden_size`` not divisible by
            the heads without ``head_dim``, heads not a multiple of the KV heads,
            ``num_experts_per_tok`` above the expert count.
        TypeError: ``hf_config`` is neither a mapping nor a ``PretrainedConfig``.
    """
    cfg = _as_mapping(hf_config)
    head = _head(cfg, source)  # first: an unsupported architecture is named by its class
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise _unsupported(source, "model_type",
                           f"{model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    _refuse_unbuildable(cfg, model_type, source)
    defaults = HF_DEFAULTS[model_type]

    def size(name: str) -> int:
        return _int_field(cfg[name] if name in cfg else defaults[name], name, source)

    hidden, heads = size("hidden_size"), size("num_attention_heads")
    kv_heads = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else defaults["num_key_value_heads"]
    kv_heads = _int_field(heads if kv_heads is None else kv_heads, "num_key_value_heads", source)
    if heads % kv_heads:
        raise _field_error(source, "num_attention_heads",
                           f"{heads} is not a multiple of num_key_value_heads={kv_heads}")
    if cfg.get("head_dim") is None and "head_dim" not in defaults and hidden % heads:
        raise _field_error(source, "hidden_size", f"{hidden} is not divisible by num_attention_heads={heads} "
                                                  "(set head_dim explicitly)")
    head_dim = _int_field(cfg.get("head_dim") or defaults.get("head_dim") or hidden // heads, "head_dim", source)
    theta, llama3_factor, linear_factor = _rope(cfg, defaults["rope_theta"], source)

    def number(name: str) -> float:
        value = cfg.get(name)
        return _float_field(defaults[name] if value is None else value, name, source)

    vocab_size = size("vocab_size")
    _check_token_ids(cfg, vocab_size, source)
    eps = cfg.get("rms_norm_eps")
    return ModelSpec(
        model_type=model_type, num_layers=size("num_hidden_layers"), hidden_size=hidden,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        ffn_hidden_size=size("intermediate_size"), vocab_size=vocab_size,
        tie_word_embeddings=_bool_field(cfg, "tie_word_embeddings", source) and head == "lm_head",
        qkv_bias=model_type == "qwen2",
        norm_eps=_positive_float(defaults["rms_norm_eps"] if eps is None else eps, "rms_norm_eps", source),
        rope_theta=theta,
        rope_scaling_factor=llama3_factor, rope_interpolation_factor=linear_factor,
        max_position_embeddings=size("max_position_embeddings"), attention_dropout=number("attention_dropout"),
        initializer_range=number("initializer_range"), head=head, source=source,
        qk_norm=model_type in QK_NORM_MODEL_TYPES, **_moe_fields(cfg, model_type, source),
    )


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary: the smallest multiple of ``divisible_by * tp`` that is
    >= ``vocab_size`` (megatron-core's ``make_vocab_size_divisible_by`` rule).

    Raises:
        ValueError: a non-positive argument.
    """
    if vocab_size < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"vocab_size, tp and divisible_by must be >= 1, got {vocab_size}, {tp}, {divisible_by}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class LayerParameters:
    """Parameters of one transformer layer, split by how the model-parallel ranks hold them.

    ``sharded`` is divided by the TP size (QKV/O/dense-MLP weights, the q/k/v biases);
    ``replicated`` is held whole on every TP rank (the two norms, the q/k norms, an MoE
    router); ``experts`` (mixture of experts) is divided by the EP size, and within an
    expert by the expert-TP size, megatron-core's default for which is the TP size.
    """

    sharded: int
    replicated: int
    experts: int = 0

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.experts


def layer_parameters(spec: ModelSpec) -> LayerParameters:
    """Parameters of one decoder layer.

    Attention: ``h*(a + 2*g)*d`` for Q, K, V and ``a*d*h`` for O (``a`` heads, ``g`` KV
    heads, ``d`` head_dim), q/k/v biases ``(a + 2*g)*d`` (Qwen2); SwiGLU MLP ``3*h*f``, or
    for a mixture of ``E`` experts of width ``f_e`` the experts ``E*3*h*f_e`` and the
    router ``E*h``; two RMSNorm weights ``2*h``, and ``2*d`` for the q/k norms (Qwen3) (no
    o_proj or MLP biases: :func:`model_spec` refuses them).
    """
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    qkv_out = (spec.num_attention_heads + 2 * spec.num_key_value_heads) * d
    sharded = h * qkv_out + spec.num_attention_heads * d * h + (0 if spec.is_moe else 3 * h * f)
    sharded += qkv_out if spec.qkv_bias else 0
    replicated = 2 * h + (2 * d if spec.qk_norm else 0) + spec.num_experts * h
    experts = spec.num_experts * 3 * h * spec.moe_ffn_hidden_size
    return LayerParameters(sharded=sharded, replicated=replicated, experts=experts)


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


def stage_parameters(spec: ModelSpec, tp: int, pp: int, head: str = "lm", ep: int = 1) -> tuple[int, ...]:
    """Parameters held by one rank of each pipeline stage at ``tp`` x ``pp`` (x ``ep``).

    Megatron's layout: stage 0 holds the (TP-sharded, padded) embedding, the last stage
    the final norm and the output layer; with tied embeddings and ``pp > 1`` the last
    stage keeps its own copy of the embedding for the output. Layers are split evenly.

    Returns:
        One count per stage (index = pipeline rank).
    """
    vocab = padded_vocab_size(spec.vocab_size, tp)
    layer = layer_parameters(spec)
    if ep < 1 or (spec.is_moe and spec.num_experts % ep) or (not spec.is_moe and ep != 1):
        raise ValueError(f"ep={ep} must divide num_experts={spec.num_experts}" if spec.is_moe
                         else f"ep={ep}: expert parallelism needs a mixture-of-experts model")
    per_layer = -(-layer.sharded // tp) + layer.replicated + layer.experts // ep // tp
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
