"""CPU accommodations: scoped to the named Megatron modules/functions, idempotent, CUDA no-op."""
from __future__ import annotations

import importlib

import pytest
import torch

from megaflow.megatron import cpu_compat

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")


def test_apply_is_idempotent_and_scoped():
    assert cpu_compat.apply_cpu_accommodations()
    schedules = importlib.import_module("megatron.core.pipeline_parallel.schedules")
    proxy = schedules.torch
    assert cpu_compat.apply_cpu_accommodations()
    assert schedules.torch is proxy  # second call installs nothing new
    for name in cpu_compat._DEVICE_MODULES:
        assert importlib.import_module(name).torch is proxy
    # inside a patched module: CUDA devices become CPU
    assert proxy.zeros([], dtype=torch.int, device="cuda").device.type == "cpu"
    assert proxy.empty(3, device=proxy.cuda.current_device()).device.type == "cpu"
    assert proxy.Tensor is torch.Tensor and proxy.float32 is torch.float32
    proxy.cuda.synchronize()
    # everywhere else torch is untouched
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(1, device="cuda")
    assert torch.zeros(1).type() == "torch.FloatTensor"


def test_grad_clipping_runs_on_cpu_grads():
    cpu_compat.apply_cpu_accommodations()
    from megatron.core.optimizer import optimizer as megatron_optimizer

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    params[0].grad = torch.tensor([3.0, 0.0, 4.0])
    params[1].grad = torch.full((2, 2), 1.0)
    total = float(torch.cat([p.grad.flatten() for p in params]).norm())
    megatron_optimizer.clip_grad_by_total_norm_fp32(params, max_norm=1.0, total_norm=total)
    assert torch.allclose(params[0].grad, torch.tensor([3.0, 0.0, 4.0]) / (total + 1e-6))
    assert torch.zeros(1).type() == "torch.FloatTensor"  # restored after the call


def test_no_op_when_cuda_is_available(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not cpu_compat.cpu_accommodations_needed()
    assert cpu_compat.apply_cpu_accommodations() is False


def test_seed_rejects_negative():
    with pytest.raises(ValueError, match="seed"):
        cpu_compat.model_parallel_manual_seed(-1)
