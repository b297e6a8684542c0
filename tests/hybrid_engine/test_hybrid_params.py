"""How the resharder reads parameters: partitioning from megatron attributes or names,
global layer names, and clear errors on inconsistent input (no processes)."""
import pytest
import torch

from megaflow.hybrid_engine.params import (count_local_layers, describe_local_params,
                                           partition_of, to_global_name)


def _megatron_param(shape, tp, dim=None, stride=1):
    p = torch.nn.Parameter(torch.zeros(shape))
    p.tensor_model_parallel = tp
    if tp:
        p.partition_dim, p.partition_stride = dim, stride
    return p


@pytest.mark.parametrize("name, dim, stride", [
    ("embedding.word_embeddings.weight", 0, 1),
    ("output_layer.weight", 0, 1),
    ("decoder.layers.3.self_attention.linear_qkv.weight", 0, 1),
    ("decoder.layers.3.self_attention.linear_qkv.bias", 0, 1),
    ("decoder.layers.3.self_attention.linear_proj.weight", 1, 1),
    ("decoder.layers.3.mlp.linear_fc1.weight", 0, 2),
    ("decoder.layers.3.mlp.linear_fc2.weight", 1, 1),
    ("decoder.layers.3.mlp.linear_fc1.layer_norm_weight", None, 1),  # TE spec: replicated
    ("decoder.layers.3.input_layernorm.weight", None, 1),
    ("module.module.decoder.final_layernorm.weight", None, 1),
])
def test_partition_by_name(name, dim, stride):
    assert partition_of(name, torch.zeros(4, 4), gated_linear_unit=True) == (dim, stride)


def test_ungated_fc1_has_stride_one():
    assert partition_of("decoder.layers.0.mlp.linear_fc1.weight", torch.zeros(4, 4),
                        gated_linear_unit=False) == (0, 1)


def test_megatron_attributes_win_and_contradictions_raise():
    replicated = _megatron_param((4,), tp=False)
    assert partition_of("decoder.layers.0.self_attention.linear_qkv.bias", replicated,
                        gated_linear_unit=True) == (None, 1)
    unknown = _megatron_param((4, 4), tp=True, dim=1)
    assert partition_of("decoder.layers.0.custom.weight", unknown, gated_linear_unit=True) == (1, 1)
    wrong = _megatron_param((8, 4), tp=True, dim=0, stride=1)
    with pytest.raises(ValueError, match="linear_fc1.weight.*refusing to guess"):
        partition_of("decoder.layers.0.mlp.linear_fc1.weight", wrong, gated_linear_unit=True)


def test_global_names_and_layer_counts():
    assert to_global_name("module.decoder.layers.2.mlp.linear_fc2.weight", 5) == \
        "decoder.layers.7.mlp.linear_fc2.weight"
    assert to_global_name("embedding.word_embeddings.weight", 5) == "embedding.word_embeddings.weight"
    assert count_local_layers(["decoder.layers.1.a", "decoder.layers.0.b", "output_layer.weight"]) == 2
    with pytest.raises(ValueError, match=r"local layer indices \[0, 2\]"):
        count_local_layers(["decoder.layers.0.a", "decoder.layers.2.a"])


def test_describe_local_params_full_shapes_and_errors():
    metas = describe_local_params(
        {"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(6, 3),
         "decoder.layers.0.self_attention.linear_proj.weight": torch.zeros(3, 2)},
        tp=4, layer_offset=2, gated_linear_unit=True)
    assert [(m.name, m.full_shape, m.stride) for m in metas] == [
        ("decoder.layers.2.mlp.linear_fc1.weight", (24, 3), 2),
        ("decoder.layers.2.self_attention.linear_proj.weight", (3, 8), 1)]
    with pytest.raises(TypeError, match="'output_layer.weight' is a list"):
        describe_local_params({"output_layer.weight": [1.0]}, tp=1, layer_offset=0,
                              gated_linear_unit=True)
    with pytest.raises(ValueError, match="not divisible by its stride 2"):
        describe_local_params({"decoder.layers.0.mlp.linear_fc1.weight": torch.zeros(5, 3)},
                              tp=1, layer_offset=0, gated_linear_unit=True)
    with pytest.raises(ValueError, match="two parameters map to the global name .output_layer.weight."):
        describe_local_params({"module.output_layer.weight": torch.zeros(2, 2),
                               "output_layer.weight": torch.zeros(2, 2)},
                              tp=1, layer_offset=0, gated_linear_unit=True)
