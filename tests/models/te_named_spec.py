"""A GPT layer spec named like Transformer Engine's, built from megatron-core's local modules (no TE).

Transformer Engine's spec fuses each pre-norm into the next linear (``linear_qkv.layer_norm_weight``,
``linear_fc1.layer_norm_weight``, no ``input_layernorm`` / ``pre_mlp_layernorm`` modules) and its
modules carry ``_extra_state`` (FP8 metadata), its attention too. This fixture reproduces those names
and that extra state with local modules, so a checkpoint can be written and read in TE's naming on CPU.
"""
from __future__ import annotations

import copy

import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.identity_op import IdentityOp

EXTRA_STATE = torch.tensor([7.0, 3.0])  # what the fixture's attention reports as its _extra_state


class NormColumnParallelLinear(ColumnParallelLinear):
    """RMSNorm fused into a column-parallel linear (TE's ``LayerNormColumnParallelLinear`` naming)."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.eps = config.layernorm_epsilon
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))

    def forward(self, input_, *args, **kwargs):
        normed = torch.nn.functional.rms_norm(input_, (input_.shape[-1],), self.layer_norm_weight, self.eps)
        return super().forward(normed, *args, **kwargs)


class NormBiasColumnParallelLinear(NormColumnParallelLinear):
    """With a LayerNorm-style bias on the fused norm: a tensor no RMSNorm checkpoint holds."""

    def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
        super().__init__(input_size, output_size, config=config, **kwargs)
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, dtype=config.params_dtype))


class AttentionWithExtraState(DotProductAttention):
    """Local attention that keeps an ``_extra_state`` like TE's ``TEDotProductAttention``."""

    def get_extra_state(self):
        return EXTRA_STATE.clone()

    def set_extra_state(self, state):
        self.restored_extra_state = state


def te_named_layer_spec(*, norm_bias: bool = False):
    """megatron-core's local spec (RMSNorm) renamed to TE's layout (see the module docstring)."""
    linear = NormBiasColumnParallelLinear if norm_bias else NormColumnParallelLinear
    spec = copy.deepcopy(get_gpt_layer_local_spec(normalization="RMSNorm"))
    layer = spec.submodules
    layer.input_layernorm = IdentityOp
    layer.pre_mlp_layernorm = IdentityOp
    layer.self_attention.submodules.linear_qkv = linear
    layer.self_attention.submodules.core_attention = AttentionWithExtraState
    layer.mlp.submodules.linear_fc1 = linear
    layer.sharded_state_dict_keys_map = {}
    return spec


def build_te_named_gpt(hf_config, *, norm_bias: bool = False):
    """This rank's GPTModel with :func:`te_named_layer_spec` (same sizes as ``build_gpt_model``)."""
    from megatron.core.models.gpt import GPTModel

    from megaflow.topology.model_spec import model_spec
    from megaflow.megatron import parallel
    from megaflow.megatron.model import padded_vocab_size, transformer_config_from_hf

    info, arch = parallel.current_parallel_info(), model_spec(hf_config)
    config = transformer_config_from_hf(hf_config, dtype=torch.float32, tensor_model_parallel_size=info.tp_size,
                                        pipeline_model_parallel_size=info.pp_size)
    return GPTModel(config=config, transformer_layer_spec=te_named_layer_spec(norm_bias=norm_bias),
                    vocab_size=padded_vocab_size(arch.vocab_size, info.tp_size),
                    max_sequence_length=arch.max_position_embeddings, pre_process=info.is_first_pp_stage,
                    post_process=info.is_last_pp_stage, parallel_output=True,
                    share_embeddings_and_output_weights=False, position_embedding_type="rope",
                    rotary_base=arch.rope_theta)
