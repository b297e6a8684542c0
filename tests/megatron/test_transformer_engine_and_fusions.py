"""TE detection as megatron-core decides it, the GPU fusion defaults, the causal-mask argument
and the planner's fused-attention choice (CUDA and Transformer Engine mocked; no process)."""
from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
from megatron.core.models.gpt import gpt_layer_specs as specs  # imported before TE is faked

from megaflow.topology import transformer_engine as te_mod
from megaflow.megatron import cpu_compat
from megaflow.megatron import model as M
from megatron_testlib import tiny_llama_config

FUSIONS = ("bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion", "apply_rope_fusion",
           "gradient_accumulation_fusion")


@pytest.fixture(autouse=True)
def fresh_decision():
    te_mod._megatron_te_problem.cache_clear()
    te_mod._warn_once.cache_clear()
    yield
    te_mod._megatron_te_problem.cache_clear()
    te_mod._warn_once.cache_clear()


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


@pytest.fixture
def te_installed(monkeypatch):
    """``import transformer_engine`` succeeds (an empty module) ..."""
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    real = te_mod.importlib.util.find_spec
    monkeypatch.setattr(te_mod.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real(name, *a))


def _specs(monkeypatch, have_te: bool, provider: bool = True, spec_error: Exception | None = None):
    monkeypatch.setattr(specs, "HAVE_TE", have_te)
    if provider:
        monkeypatch.setattr(specs, "TESpecProvider", object, raising=False)
    else:
        monkeypatch.delattr(specs, "TESpecProvider", raising=False)

    def te_spec(*args, **kwargs):
        if spec_error is not None:
            raise spec_error
        return "te-spec"

    monkeypatch.setattr(specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    return specs


def test_no_cuda_means_no_te_and_no_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert not te_mod.transformer_engine_usable()
    assert not caplog.records


def test_importable_te_without_megatron_core_extension_falls_back(on_gpu, te_installed, monkeypatch, caplog):
    """The old check (``import transformer_engine`` succeeds) said usable; megatron-core's
    ``HAVE_TE`` is False, so its TE spec cannot be built: local spec, one warning line."""
    _specs(monkeypatch, have_te=False)
    with caplog.at_level(logging.WARNING):
        assert not te_mod.transformer_engine_usable()
        assert not te_mod.transformer_engine_usable()  # decided once, warned once
    assert len(caplog.records) == 1 and "\n" not in caplog.records[0].getMessage()
    assert "HAVE_TE is False" in caplog.records[0].getMessage()


def test_missing_spec_provider_or_failing_spec_falls_back(on_gpu, te_installed, monkeypatch, caplog):
    _specs(monkeypatch, have_te=True, provider=False)
    assert not te_mod.transformer_engine_usable()
    te_mod._megatron_te_problem.cache_clear()
    _specs(monkeypatch, have_te=True, spec_error=OSError("libcudnn.so.9: cannot open shared object file\nmore"))
    with caplog.at_level(logging.WARNING):
        assert not te_mod.transformer_engine_usable()
    assert "OSError: libcudnn.so.9" in caplog.records[-1].getMessage()
    assert "\n" not in caplog.records[-1].getMessage()


def test_working_te_is_used(on_gpu, te_installed, monkeypatch, caplog):
    _specs(monkeypatch, have_te=True)
    with caplog.at_level(logging.WARNING):
        assert te_mod.transformer_engine_usable()
    assert not caplog.records


def test_fusions_are_on_on_gpu_and_off_on_cpu(monkeypatch):
    cpu = M.transformer_config_from_hf(tiny_llama_config())
    assert not any(getattr(cpu, f) for f in FUSIONS) and cpu.use_cpu_initialization
    assert cpu_compat.transformer_config_accommodations()["masked_softmax_fusion"] is False
    # GPU without TE or apex kernels: the JIT fusions only (TransformerConfig is built on CPU
    # here, so the GPU branch is reached by the CPU module answering "CUDA present").
    monkeypatch.setattr(cpu_compat, "cpu_accommodations_needed", lambda: False)
    monkeypatch.setattr(M, "transformer_engine_usable", lambda: False)
    gpu = M.transformer_config_from_hf(tiny_llama_config())
    assert (gpu.bias_activation_fusion, gpu.bias_dropout_fusion) == (True, True)
    assert not gpu.use_cpu_initialization
    assert cpu_compat.transformer_config_accommodations() == {}
    assert M.gpu_fusions(use_te=True)["masked_softmax_fusion"] and M.gpu_fusions(use_te=True)["apply_rope_fusion"]
    assert not M.gpu_fusions(use_te=False)["apply_rope_fusion"]
    monkeypatch.setattr(M, "_kernel_installed", lambda name: True)  # apex's kernels built
    assert all(M.gpu_fusions(use_te=False)[f] for f in ("masked_softmax_fusion", "gradient_accumulation_fusion"))


def test_causal_mask_is_explicit_on_cpu_only(monkeypatch):
    mask = cpu_compat.attention_mask_argument(3, "cpu")
    expected = torch.tensor([[False, True, True], [False, False, True], [False, False, False]])
    assert mask.shape == (1, 1, 3, 3) and torch.equal(mask[0, 0], expected)
    monkeypatch.setattr(cpu_compat, "cpu_accommodations_needed", lambda: False)
    assert cpu_compat.attention_mask_argument(3, "cpu") is None  # the backend's causal mask type


def test_planner_assumes_fused_attention_only_where_te_is_usable(monkeypatch):
    """A GPU run's activations: the unfused attention keeps the [s, s] scores, so the plan
    with TE unusable needs more memory than with TE."""
    from megaflow.dryrun import build_plan
    from megaflow.dryrun import plan as plan_mod
    from megaflow.topology import load_run

    cfg = load_run("llama3_8b_ppo")
    def actor_memory(te_usable: bool):
        monkeypatch.setattr(plan_mod, "transformer_engine_usable", lambda need_cuda: te_usable)
        return next(r.memory for r in build_plan(cfg).roles if r.role == "actor")

    fused, unfused = actor_memory(True), actor_memory(False)
    assert unfused.activations > fused.activations
