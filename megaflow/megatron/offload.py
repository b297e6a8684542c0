"""Parameter, gradient and optimizer-state offload to host memory between RL phases.

Built on megatron-core's own RL hooks where they exist (``DistributedDataParallel.
offload_grad_buffers``/``restore_grad_buffers``, ``MegatronOptimizer.offload_to_cpu``/
``restore_from_cpu``, ``_ParamAndGradBuffer.offload_to_cpu``). Parameters are offloaded by
keeping a host copy and releasing the device storage (``untyped_storage().resize_(0)``), so
every view (DDP buckets, distributed-optimizer shards) stays valid after reload.

On a CPU-only process the tensors already live in host memory: parameter and optimizer
offload walk the same code but move nothing; gradient buffers are still released and
re-allocated (zeroed), which is harmless because every train step zeroes them first.
"""
from __future__ import annotations

import torch


def _on_accelerator(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _param_buffers(model) -> list:
    """Megatron DDP's contiguous param/grad buffers (none for an unwrapped model)."""
    from megatron.core.distributed import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return []
    return list(model.buffers) + list(model.expert_parallel_buffers)


def _standalone_params(model) -> list[torch.nn.Parameter]:
    """Parameters not held in a DDP contiguous param buffer (all of them without dist-opt)."""
    in_buffer: set[int] = set()
    for buffer in _param_buffers(model):
        if getattr(buffer, "param_data", None) is not None:
            in_buffer.update(id(p) for p in buffer.params)
    return [p for p in model.parameters() if id(p) not in in_buffer]


def offload_params(model) -> None:
    """Copy parameters to (pinned) host memory and free their accelerator storage."""
    for buffer in _param_buffers(model):
        if getattr(buffer, "param_data", None) is not None and _on_accelerator(buffer.param_data):
            buffer.offload_to_cpu(move_params=True, move_grads=False)
    for p in _standalone_params(model):
        if _on_accelerator(p):
            p._megaflow_host = p.data.to("cpu", copy=True).pin_memory()  # type: ignore[attr-defined]  # megatron-style attribute on a Parameter
            p.data.untyped_storage().resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reload_params(model) -> None:
    """Undo :func:`offload_params`."""
    for buffer in _param_buffers(model):
        if getattr(buffer, "param_data", None) is not None and _on_accelerator(buffer.param_data):
            buffer.reload_from_cpu(move_params=True, move_grads=False)
    for p in _standalone_params(model):
        host = getattr(p, "_megaflow_host", None)
        if host is not None:
            p.data.untyped_storage().resize_(host.numel() * host.element_size())
            p.data.copy_(host, non_blocking=True)
            del p._megaflow_host  # type: ignore[attr-defined]  # set by offload above


def offload_grads(model) -> None:
    """Release the DDP gradient buffers (megatron-core ``offload_grad_buffers``)."""
    cuda = torch.cuda.is_available()
    model.offload_grad_buffers(synchronize=cuda, empty_cache=cuda)


def reload_grads(model) -> None:
    """Re-allocate (zeroed) DDP gradient buffers."""
    model.restore_grad_buffers(synchronize=torch.cuda.is_available())


def offload_optimizer(optimizer) -> None:
    """Move optimizer states (Adam moments, fp32 main params) to host memory."""
    optimizer.offload_to_cpu()


def reload_optimizer(optimizer) -> None:
    """Undo :func:`offload_optimizer` (nothing to do when there is no accelerator)."""
    if torch.cuda.is_available():
        optimizer.restore_from_cpu()


__all__ = ["offload_params", "reload_params", "offload_grads", "reload_grads",
           "offload_optimizer", "reload_optimizer"]
