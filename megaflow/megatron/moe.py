"""megatron-core mixture-of-experts settings for a Qwen3-MoE :class:`ModelSpec`.

:func:`moe_transformer_config_fields` maps the HF router and experts onto megatron-core's
``MoELayer`` (``TopKRouter`` + ``SequentialMLP`` experts + the all-gather token
dispatcher); :func:`check_moe_supported` refuses the MoE settings megaflow cannot run on
this machine, naming the field and why. Kept apart from :mod:`megaflow.megatron.model` so
the dense builder stays as it was.

Router equivalence (HF ``Qwen3MoeTopKRouter`` vs megatron-core ``TopKRouter`` with
``moe_router_score_function="softmax"``): HF takes ``softmax`` over all experts, then the
top-k probabilities, renormalised to sum 1 when ``norm_topk_prob``. megatron-core with
``moe_router_pre_softmax=True`` takes the softmax over all experts then the top-k (HF
without renormalisation); with ``pre_softmax=False`` it takes the top-k logits then a
softmax over those k, which equals the renormalised top-k probabilities
(``exp(l_i) / sum_{j in topk} exp(l_j)``), HF with ``norm_topk_prob``.
"""
from __future__ import annotations

from typing import Any

from megaflow.topology.model_spec import ModelSpec


def check_moe_supported(arch: ModelSpec, *, tp: int, on_cpu: bool, grouped_gemm: bool = False) -> None:
    """Raise ValueError for an MoE setting megaflow does not run.

    Refused: grouped GEMM on CPU (megatron-core's ``GroupedMLP`` / ``TEGroupedMLP`` need
    CUDA kernels); tp > 1 with experts on CPU (``MoELayer.forward`` refuses training with
    TP > 1 unless sequence parallelism is on, and sequence parallelism needs Transformer
    Engine, hence CUDA).

    Args:
        arch: the model (no-op for dense models).
        tp: the tensor-parallel size of the role.
        on_cpu: whether the model runs without CUDA.
        grouped_gemm: whether grouped GEMM experts were asked for.
    """
    if not arch.is_moe:
        return
    if on_cpu and grouped_gemm:
        raise ValueError(f"{arch.source}: moe_grouped_gemm needs CUDA grouped-GEMM kernels; on CPU the "
                         "experts run as megatron-core's SequentialMLP")
    if on_cpu and tp > 1:
        raise ValueError(f"tp={tp} with a mixture-of-experts model ({arch.source}.num_experts="
                         f"{arch.num_experts}) needs sequence parallelism, which needs CUDA: use tp=1 "
                         "(and expert parallelism) on CPU")


def moe_transformer_config_fields(arch: ModelSpec) -> dict[str, Any]:
    """``TransformerConfig`` fields of the MoE layers (empty for a dense model).

    Args:
        arch: a Qwen3-MoE spec.

    Returns:
        Keyword arguments for ``TransformerConfig``: expert count and width, top-k, the
        softmax router (see the module docstring for the ``pre_softmax`` choice), fp32
        routing, the all-gather token dispatcher, no grouped GEMM, no fusions, and no
        auxiliary load-balancing or z-loss of megatron-core's (``moe_router_load_balancing_type="none"``:
        the model's forward is the HF model's; megatron-core normalises those per micro-batch,
        megaflow adds its own, normalised over the mini-batch: ``actor.moe_aux_loss_coeff``,
        :mod:`megaflow.megatron.router_aux_loss`).
    """
    if not arch.is_moe:
        return {}
    return dict(
        num_moe_experts=arch.num_experts, moe_router_topk=arch.moe_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size, moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.moe_norm_topk_prob, moe_router_dtype="fp32",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,
        moe_token_dispatcher_type="allgather", moe_grouped_gemm=False,
        moe_permute_fusion=False, moe_router_fusion=False,
    )


def moe_layer_spec_kwargs(arch: ModelSpec) -> dict[str, Any]:
    """Keyword arguments of megatron-core's GPT layer-spec builders for the MLP: the expert
    count (None for dense models) and SequentialMLP experts (no grouped GEMM)."""
    if not arch.is_moe:
        return {}
    return {"num_experts": arch.num_experts, "moe_grouped_gemm": False}


__all__ = ["check_moe_supported", "moe_transformer_config_fields", "moe_layer_spec_kwargs"]
