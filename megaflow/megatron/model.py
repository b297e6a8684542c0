"""Build megatron-core GPT models from Llama/Qwen2-family Hugging Face configs.

:func:`transformer_config_from_hf` maps an HF ``config.json``, read by the one
architecture reader :func:`megaflow.topology.model_spec.model_spec` (which refuses features
megaflow cannot reproduce exactly), to a megatron-core ``TransformerConfig``;
:func:`build_gpt_model` builds this rank's TP shard / PP stage of a ``GPTModel`` with an LM
head (actor, reference) or a scalar value/reward head (critic, reward model).

Parameter names of the built model (PP stage-local layer numbers, 0-based):

* ``embedding.word_embeddings.weight`` ``[padded_vocab / tp, hidden]`` (first stage);
* ``decoder.layers.{i}.self_attention.linear_qkv.{weight,bias}``: fused QKV grouped per KV
  head, ``bias`` only with ``add_qkv_bias`` (Qwen2);
  ``...self_attention.linear_qkv.layer_norm_weight`` (TE spec) or
  ``decoder.layers.{i}.input_layernorm.weight`` (local spec);
* ``...self_attention.linear_proj.weight``, ``...mlp.linear_fc1.weight`` (gate then up
  per TP shard), ``...mlp.linear_fc2.weight``, ``...pre_mlp_layernorm.weight`` (local spec)
  or ``...mlp.linear_fc1.layer_norm_weight`` (TE spec);
* mixture of experts (Qwen3-MoE, :mod:`megaflow.megatron.moe`): ``...mlp.router.weight``
  ``[experts, hidden]`` and ``...mlp.experts.local_experts.{j}.linear_fc{1,2}.weight`` for
  this EP rank's experts ``j`` (global ``ep_rank * experts / ep + j``) instead of the dense MLP;
  ``...self_attention.{q,k}_layernorm.weight`` ``[head_dim]`` for Qwen3 (q/k norms);
* ``decoder.final_layernorm.weight`` (last stage);
* LM head (``head="lm"``): ``output_layer.weight`` ``[padded_vocab / tp, hidden]`` (last stage; absent when
  embeddings are tied and pp == 1, and a synchronised copy of the embedding when tied
  and pp > 1);
* value / reward head (``head="value"`` / ``"reward"``): ``output_layer.weight`` ``[1, hidden]``, a :class:`ScalarHead`
  replicated on every TP rank of the last stage. It corresponds to HF
  ``*ForSequenceClassification``'s ``score.weight`` (``[num_labels=1, hidden]``, no bias).
"""
from __future__ import annotations

import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from megaflow.megatron import cpu_compat, moe, parallel
from megaflow.topology.model_spec import SUPPORTED_MODEL_TYPES, ModelSpec, model_spec, padded_vocab_size
from megaflow.topology.transformer_engine import transformer_engine_usable

#: Model heads: the LM head (actor, reference), the critic's value head, the reward model's head.
HEADS = ("lm", "value", "reward")


def check_tp_divides_heads(arch: ModelSpec, tp: int) -> None:
    """Raise ValueError unless ``tp`` divides the attention heads and the KV heads."""
    if arch.num_attention_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_attention_heads="
                         f"{arch.num_attention_heads} (HF field 'num_attention_heads')")
    if arch.num_key_value_heads % tp:
        raise ValueError(f"tp={tp} does not divide num_key_value_heads={arch.num_key_value_heads} "
                         f"(HF field 'num_key_value_heads')")


def _kernel_installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def gpu_fusions(use_te: bool) -> dict[str, bool]:
    """megatron-core's fusions, on wherever their kernel exists (the GPU defaults).

    The bias-activation (SwiGLU) and bias-dropout-add fusions are torch JIT code;
    attention's masked-softmax fusion runs in TE's attention, or in apex's
    ``scaled_upper_triang_masked_softmax_cuda`` for the local spec; RoPE fusion needs TE;
    gradient-accumulation fusion needs apex's ``fused_weight_gradient_mlp_cuda`` (also
    for the output layer, a megatron-core ``ColumnParallelLinear`` under either spec).
    On CPU :func:`megaflow.megatron.cpu_compat.transformer_config_accommodations` turns
    them all off.
    """
    return dict(bias_activation_fusion=True, bias_dropout_fusion=True,
                masked_softmax_fusion=use_te or _kernel_installed("scaled_upper_triang_masked_softmax_cuda"),
                apply_rope_fusion=use_te,
                gradient_accumulation_fusion=_kernel_installed("fused_weight_gradient_mlp_cuda"))


def transformer_config_from_hf(hf_config: Any, *, dtype: torch.dtype = torch.float32,
                               **overrides: Any):
    """Map a Llama/Qwen2-family HF config to a megatron-core ``TransformerConfig``.

    GQA (``num_query_groups``), SwiGLU (``gated_linear_unit`` + SiLU, no linear biases),
    RMSNorm with ``rms_norm_eps``, QKV bias for Qwen2, q/k RMSNorm (``qk_layernorm``) for
    Qwen3, ``head_dim`` as ``kv_channels``.
    RoPE base/scaling and tied embeddings are GPTModel arguments (see
    :func:`build_gpt_model`). Fusions are on where their kernels exist (:func:`gpu_fusions`;
    TE as :func:`~megaflow.topology.transformer_engine.transformer_engine_usable` decides);
    on CPU they are off and ``use_cpu_initialization=True``
    (:func:`~megaflow.megatron.cpu_compat.transformer_config_accommodations`).

    Args:
        hf_config: ``transformers.PretrainedConfig`` or dict of ``config.json``.
        dtype: parameter dtype (``torch.float32`` on CPU; ``torch.bfloat16`` on GPU).
        **overrides: any ``TransformerConfig`` field, e.g. ``tensor_model_parallel_size``
            (default 1 here; :func:`build_gpt_model` fills in the live parallel sizes).

    Raises:
        ValueError: unsupported config features
            (:class:`~megaflow.topology.model_spec.UnsupportedModelError`, see
            :func:`~megaflow.topology.model_spec.model_spec`), tp not dividing heads/KV
            heads, num_layers not divisible by pp, or experts with tp > 1 or grouped GEMM on
            CPU (:func:`megaflow.megatron.moe.check_moe_supported`).
    """
    from megatron.core.transformer import TransformerConfig

    arch = model_spec(hf_config)
    kwargs: dict[str, Any] = dict(
        num_layers=arch.num_layers, hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size, num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_key_value_heads, kv_channels=arch.head_dim,
        normalization="RMSNorm", layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias, qk_layernorm=arch.qk_norm, attention_dropout=arch.attention_dropout,
        hidden_dropout=0.0, init_method_std=arch.initializer_range,
        params_dtype=dtype, pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True, sequence_parallel=False,  # overridable (GPU, TE spec)
        persist_layer_norm=False,  # apex's LayerNorm kernel; the models use RMSNorm
        **gpu_fusions(transformer_engine_usable()),
    )
    kwargs.update(moe.moe_transformer_config_fields(arch))  # issue 34: Qwen3-MoE (empty when dense)
    kwargs.update(cpu_compat.transformer_config_accommodations())
    kwargs.update(overrides)
    check_tp_divides_heads(arch, kwargs.get("tensor_model_parallel_size", 1))
    moe.check_moe_supported(arch, tp=kwargs.get("tensor_model_parallel_size", 1),
                            on_cpu=cpu_compat.cpu_accommodations_needed(),
                            grouped_gemm=kwargs.get("moe_grouped_gemm", False))
    pp = kwargs.get("pipeline_model_parallel_size", 1)
    vpp = kwargs.get("virtual_pipeline_model_parallel_size") or 1
    uneven = kwargs.get("num_layers_in_first_pipeline_stage") or kwargs.get(
        "num_layers_in_last_pipeline_stage")
    if not uneven and arch.num_layers % (pp * vpp):
        raise ValueError(f"num_hidden_layers={arch.num_layers} is not divisible by pp*vpp="
                         f"{pp * vpp}")
    return TransformerConfig(**kwargs)


class ScalarHead(torch.nn.Module):
    """Value / reward head ``hidden -> 1`` that replaces ``GPTModel.output_layer``.

    Called like Megatron's output layer: ``head(hidden_states [s, b, h]) -> ([s, b, 1], None)``.
    Replicated on every TP rank (the decoder's output is replicated without sequence
    parallelism); ``weight`` is ``[1, hidden]`` like HF ``score.weight``.
    """

    def __init__(self, hidden_size: int, *, init_std: float, dtype: torch.dtype,
                 device: torch.device | str, seed: int = 0, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.sequence_parallel = sequence_parallel
        generator = torch.Generator().manual_seed(seed)
        weight = torch.randn(1, hidden_size, generator=generator, dtype=torch.float32) * init_std
        self.weight = torch.nn.Parameter(weight.to(device=device, dtype=dtype))
        # Replicated across TP: Megatron counts it once in the grad norm (tp rank 0).
        # megatron-core reads these attributes off a Parameter (torch's stubs do not declare them)
        self.weight.tensor_model_parallel = False  # type: ignore[attr-defined]
        self.weight.sequence_parallel = False  # type: ignore[attr-defined]

    def forward(self, hidden_states: torch.Tensor, weight: torch.Tensor | None = None,
                runtime_gather_output: bool | None = None):
        if self.sequence_parallel:  # [s/tp, b, h] -> [s, b, h]: the head sees every position
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden_states = gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight), None


def build_gpt_model(hf_config: Any, *, head: str = "lm", dtype: torch.dtype = torch.float32,
                    max_sequence_length: int | None = None, head_seed: int = 0,
                    transformer_engine: bool | None = None, **config_overrides: Any):
    """Build this rank's TP shard and PP stage of a megatron-core ``GPTModel``.

    Needs :func:`megaflow.megatron.parallel.initialize_parallel` first. Uses the Transformer
    Engine layer spec when CUDA is available and megatron-core can build it
    (:func:`~megaflow.topology.transformer_engine.transformer_engine_usable`), else the local
    spec (with one warning line on a GPU). The vocabulary is padded with
    ``padded_vocab_size(vocab, tp, 128)``; critic/reward models end in a :class:`ScalarHead`
    (parameter names in the module docstring).

    Args:
        hf_config: ``transformers.PretrainedConfig`` or dict of ``config.json``.
        head: ``"lm"`` (LM head, logits ``[b, s, padded_vocab / tp]``), ``"value"`` (critic) or
            ``"reward"`` (reward model): a scalar head, ``[b, s, 1]``.
        dtype: parameter dtype.
        max_sequence_length: RoPE table length; default HF ``max_position_embeddings``.
        head_seed: seed of the scalar head's initialisation (same on every rank).
        transformer_engine: False: megatron-core's local layer spec even where Transformer Engine
            is usable (LoRA adapters, :mod:`megaflow.megatron.lora`, need the local spec's
            unfused norm + linear); None: TE where usable.
        **config_overrides: extra ``TransformerConfig`` fields.

    Raises:
        ValueError: unknown head, unsupported config, tp not dividing heads / KV heads,
            layers not divisible by pp.
        NotImplementedError: virtual pipeline parallelism (vpp > 1) or cp > 1.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    info = parallel.current_parallel_info()
    if info.vpp_size is not None:
        raise NotImplementedError("virtual pipeline parallelism (vpp > 1) is validated but "
                                  "not built: megaflow builds one model chunk per rank")
    if info.cp_size > 1:
        raise NotImplementedError("context parallelism (cp > 1) is not supported by "
                                  "megaflow's models yet")
    arch = model_spec(hf_config)
    if transformer_engine is False:  # the local spec: off the fusions only TE provides
        without_te = gpu_fusions(False)
        config_overrides = {"masked_softmax_fusion": without_te["masked_softmax_fusion"],
                            "apply_rope_fusion": without_te["apply_rope_fusion"], **config_overrides}
    config = transformer_config_from_hf(
        hf_config, dtype=dtype, tensor_model_parallel_size=info.tp_size,
        pipeline_model_parallel_size=info.pp_size, expert_model_parallel_size=info.ep_size,
        **config_overrides)
    use_te = transformer_engine_usable() and transformer_engine is not False
    if config.sequence_parallel and not use_te:
        raise ValueError("sequence_parallel needs Transformer Engine's layer spec (CUDA + transformer_engine): "
                         "megatron-core's local spec builds its norms with WrappedTorchNorm, which refuses "
                         "sequence parallelism")
    mlp = moe.moe_layer_spec_kwargs(arch)  # issue 34: experts (empty when dense)
    spec = (get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_norm, **mlp) if use_te
            else get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm, **mlp))
    tie = arch.tie_word_embeddings and head == "lm"
    model = GPTModel(
        config=config, transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, info.tp_size),
        max_sequence_length=max_sequence_length or arch.max_position_embeddings,
        pre_process=info.is_first_pp_stage, post_process=info.is_last_pp_stage,
        parallel_output=True, share_embeddings_and_output_weights=tie,
        position_embedding_type="rope", rotary_base=arch.rope_theta,
        rope_scaling=arch.rope_scaling_factor is not None,
        rope_scaling_factor=arch.rope_scaling_factor or 8.0,
        seq_len_interpolation_factor=arch.rope_interpolation_factor)
    if head != "lm" and info.is_last_pp_stage:
        device = next(model.parameters()).device
        model.output_layer = ScalarHead(arch.hidden_size, init_std=config.init_method_std,
                                        dtype=dtype, device=device, seed=head_seed,
                                        sequence_parallel=config.sequence_parallel)
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    return model


__all__ = ["ScalarHead", "build_gpt_model", "check_tp_divides_heads", "gpu_fusions",
           "padded_vocab_size", "transformer_config_from_hf",
           "SUPPORTED_MODEL_TYPES", "HEADS"]
