"""CPU accommodations for megatron-core 0.16.1: the ONE place where megaflow bends Megatron.

megatron-core assumes CUDA in a few places that the CPU path (development, CI, laptops;
gloo instead of NCCL) reaches. Each accommodation below names the Megatron functions it
covers and why. :func:`apply_cpu_accommodations` installs them once per process and is
a no-op when CUDA is available, so no accommodation is active on the GPU path. The one
function here that also runs on CUDA, :func:`model_parallel_manual_seed`, is there exactly
Megatron's ``model_parallel_cuda_manual_seed``.

The accommodations, all minimal and none a copy of Megatron code:

1. **"cuda" devices in a handful of Megatron modules** (``_DEVICE_MODULES``): those modules
   allocate buffers with ``device="cuda"`` or ``device=torch.cuda.current_device()``.
   Their module-global name ``torch`` is rebound to :class:`_CpuTorch`, a thin view of
   ``torch`` whose tensor factories turn a CUDA device into ``cpu`` and whose
   ``torch.cuda.current_device()`` answers ``"cpu"`` and ``torch.cuda.synchronize()``
   does nothing. Every other attribute is the real ``torch``; no other module sees it.
2. **CUDA tensor type names** (``_CUDA_TYPE_NAME_FUNCTIONS``): Megatron's optimizers and
   gradient clipping check ``tensor.type()`` against ``'torch.cuda.FloatTensor'`` (and the
   half/bf16 names). While exactly those functions run, ``Tensor.type()`` without
   arguments reports a CPU tensor under its CUDA name.
3. **``Tensor.cuda()`` in a named function** (``_TENSOR_CUDA_FUNCTIONS``): with tied
   embeddings and pp > 1, ``LanguageModule.setup_embeddings_and_output_layer`` moves the
   shared weight with ``weight.data.cuda()``; while exactly that function runs,
   ``Tensor.cuda()`` returns the CPU tensor.
4. **The CUDA RNG tracker**: ``model_parallel_cuda_manual_seed`` stores CUDA generator
   states (``torch.cuda.get_rng_state`` fails on a CPU build) and every attention layer
   enters ``get_cuda_rng_tracker().fork()``. :func:`model_parallel_manual_seed` seeds
   torch's CPU generator and installs Megatron's own pass-through tracker
   (``inference_rng_tracker=True``), so forks are no-ops and all randomness (CPU
   initialisation, dropout) draws from the CPU generator. (So on CPU, dropout inside
   TP regions is not decorrelated across TP ranks; megaflow's models use dropout 0 for
   hidden states and the HF config's attention dropout, 0 for Llama/Qwen2.) On CUDA it
   is exactly ``model_parallel_cuda_manual_seed(seed)``.
5. **CUDA RNG state in activation recomputation** (``_CPU_RNG_STATE_FUNCTIONS``):
   ``tensor_parallel.CheckpointFunction`` (full recomputation) and the selective
   core-attention checkpoint save and restore the CUDA generator's state around the
   recomputed forward (``_get_cuda_rng_state`` / ``_set_cuda_rng_state``). On a CPU build
   there is no CUDA generator: those two functions are replaced by ones that return an
   empty state and ignore it. The CPU generator's state, which is what draws on CPU
   (accommodation 4), is still saved and restored by the same Megatron code.
6. **Transformer Engine names a Megatron module uses unguarded** (``_TE_ONLY_NAMES``):
   ``moe_utils`` imports ``te_general_gemm`` inside ``try`` (absent without TE) but
   ``RouterGatingLinearFunction`` tests ``te_general_gemm is not None``, a ``NameError``
   when TE is missing (every CPU machine). The name is bound to ``None``, Megatron's own
   "no TE" value, so the router takes its ``torch.mm`` path.
7. **The default causal mask** (``megatron.core.transformer.utils.get_default_causal_mask``,
   built on ``"cuda"``) is not patched: on CPU megaflow passes an explicit ``[1, 1, s, s]``
   mask (:func:`attention_mask_argument`); on CUDA none, and the attention backend applies
   its causal mask type.
8. **TransformerConfig fields** (:func:`transformer_config_accommodations`):
   ``use_cpu_initialization=True`` and every fusion off (their kernels are CUDA code);
   :mod:`megaflow.megatron.model` applies them over its GPU defaults (fusions on).

Also required on CPU: ``sequence_parallel=False`` (refused by the model builder without TE).
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import threading
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Module -> the Megatron functions in it that allocate on a CUDA device.
_DEVICE_MODULES: dict[str, str] = {
    "megatron.core.models.common.embeddings.rotary_pos_embedding":
        "RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device() on first use",
    "megatron.core.pipeline_parallel.schedules":
        "forward_backward_no_pipelining / forward_backward_pipelining_* allocate "
        "total_num_tokens with device='cuda'",
    "megatron.core.pipeline_parallel.p2p_communication":
        "P2PCommunicator._communicate / _communicate_shapes allocate receive buffers on "
        "torch.cuda.current_device(); _batched_p2p_ops calls torch.cuda.synchronize()",
    "megatron.core.distributed.param_and_grad_buffer":
        "_ParamAndGradBuffer.__init__ allocates the contiguous param/grad buffers on "
        "torch.cuda.current_device()",
    "megatron.core.optimizer.clip_grads":
        "get_grad_norm_fp32 / clip_grad_by_total_norm_fp32 / count_zeros_fp32 allocate "
        "norm and overflow buffers with device='cuda'",
    "megatron.core.optimizer.optimizer":
        "FP32Optimizer.get_loss_scale and MixedPrecisionOptimizer.__init__ allocate on "
        "torch.cuda.current_device() / device='cuda'",
    "megatron.core.optimizer.distrib_optimizer":
        "DistributedOptimizer allocates shard buffers on torch.cuda.current_device()",
    "megatron.core.dist_checkpointing.strategies.filesystem_async":
        "FileSystemWriterAsync.preload_tensors calls torch.cuda.synchronize() after its "
        "device-to-host copies (dist_checkpointing.save)",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver":
        "save_state_dict_async_finalize / verify_global_md_reuse allocate their agreement "
        "flags on torch.cuda.current_device() / device='cuda'",
    "megatron.core.dist_checkpointing.strategies.async_utils":
        "AsyncRequest.execute_sync and the async-call queue synchronise CUDA and allocate "
        "flags on torch.cuda.current_device()",
    "megatron.core.dist_checkpointing.strategies.fully_parallel":
        "FullyParallelSaveStrategyWrapper / FullyParallelLoadStrategyWrapper call "
        "torch.cuda.synchronize()",
    "megatron.core.utils":
        "GlobalMemoryBuffer.get_tensor (DotProductAttention.forward's score buffer) "
        "allocates on torch.cuda.current_device()",
    "megatron.core.transformer.moe.router":
        "Router.gating moves the router weight to torch.cuda.current_device() on every forward; "
        "TopKRouter.__init__ allocates expert-bias / global-aux-loss buffers there",
    "megatron.core.transformer.moe.moe_utils":
        "track_moe_metrics allocates the layer-wise aux-loss tracker with device='cuda'",
    "megatron.core.tensor_parallel.mappings":
        "_gather_along_last_dim / _gather_along_first_dim / _reduce_scatter_along_first_dim "
        "allocate outputs on torch.cuda.current_device()",
}

# (module, attribute path, why): functions run with CUDA type names for CPU tensors.
_CUDA_TYPE_NAME_FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    ("megatron.core.optimizer.optimizer", "clip_grad_by_total_norm_fp32",
     "asserts param.grad.type() == 'torch.cuda.FloatTensor' (called by "
     "MegatronOptimizer.clip_grad_norm)"),
    ("megatron.core.optimizer.optimizer", "Float16OptimizerWithFloat16Params.__init__",
     "accepts only torch.cuda.{Float,Half,BFloat16}Tensor parameters"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer.__init__",
     "accepts only torch.cuda.{Float,Half,BFloat16}Tensor parameters (in __init__ and in "
     "_build_model_and_main_param_groups, which __init__ calls)"),
)

# (module, attribute path, why): functions run with ``Tensor.cuda()`` returning the CPU tensor.
_TENSOR_CUDA_FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    ("megatron.core.models.common.language_module.language_module",
     "LanguageModule.setup_embeddings_and_output_layer",
     "with tied embeddings and pp > 1, moves the shared embedding/output weight with "
     "weight.data.cuda() before all-reducing it across the first and last stages"),
)

# (module, function, why): CUDA generator-state functions replaced by CPU no-ops.
_CPU_RNG_STATE_FUNCTIONS: tuple[tuple[str, str, str], ...] = (
    ("megatron.core.tensor_parallel.random", "_get_cuda_rng_state",
     "CheckpointFunction.forward / _fork_rng save the CUDA RNG state (recomputation)"),
    ("megatron.core.tensor_parallel.random", "_set_cuda_rng_state",
     "CheckpointFunction.backward restores it before recomputing the forward"),
)


# (module, name, why): Transformer Engine symbols bound to None when TE did not import.
_TE_ONLY_NAMES: tuple[tuple[str, str, str], ...] = (
    ("megatron.core.transformer.moe.moe_utils", "te_general_gemm",
     "RouterGatingLinearFunction.forward/backward test 'te_general_gemm is not None' (the MoE router)"),
)


def _no_cuda_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    """Stands in for Megatron's CUDA RNG get/set on CPU: no CUDA generator exists."""
    return torch.empty(0, dtype=torch.uint8)


_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "rand", "randn")
_applied = False
_apply_lock = threading.Lock()
_type_names_depth = threading.local()


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, int):  # an index as returned by torch.cuda.current_device()
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_factory(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def factory(*args, **kwargs):
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return fn(*args, **kwargs)
    return factory


class _CpuCuda(types.ModuleType):
    """``torch.cuda`` as seen by a patched Megatron module on a machine without CUDA."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")

    @staticmethod
    def current_device() -> str:
        return "cpu"

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """``torch`` as seen by a patched Megatron module: CUDA devices become ``cpu``."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCuda()
        for name in _FACTORIES:
            setattr(self, name, _cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cuda_type_name(original: Callable) -> Callable:
    @functools.wraps(original)
    def type_(self, dtype=None, non_blocking=False, **kwargs):
        name = original(self, dtype, non_blocking, **kwargs)
        if dtype is None and isinstance(name, str) and not self.is_cuda:
            return name.replace("torch.", "torch.cuda.", 1)
        return name
    return type_


@contextlib.contextmanager
def _cuda_type_names() -> Iterator[None]:
    """While active, ``Tensor.type()`` names CPU tensors as CUDA ones (re-entrant)."""
    depth = getattr(_type_names_depth, "value", 0)
    original = torch.Tensor.type
    if depth == 0:
        torch.Tensor.type = _cuda_type_name(original)  # type: ignore[method-assign]  # the CPU patch itself
    _type_names_depth.value = depth + 1
    try:
        yield
    finally:
        _type_names_depth.value = depth
        if depth == 0:
            torch.Tensor.type = original  # type: ignore[method-assign]  # restored


def _with_cuda_type_names(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)
    wrapper.__megaflow_cpu_compat__ = True  # type: ignore[attr-defined]  # marks an applied patch
    return wrapper


@contextlib.contextmanager
def _tensor_cuda_is_identity() -> Iterator[None]:
    """While active, ``Tensor.cuda()`` returns the tensor itself (it stays on the CPU)."""
    original = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # type: ignore[method-assign]  # the CPU patch itself
    try:
        yield
    finally:
        torch.Tensor.cuda = original  # type: ignore[method-assign]  # restored


def _with_tensor_cuda_identity(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _tensor_cuda_is_identity():
            return fn(*args, **kwargs)
    wrapper.__megaflow_cpu_compat__ = True  # type: ignore[attr-defined]  # marks an applied patch
    return wrapper


def _patch_type_name_function(module_name: str, path: str,
                              wrap: Callable[[Callable], Callable] = _with_cuda_type_names) -> None:
    owner: Any = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for parent in parents:
        owner = getattr(owner, parent)
    fn = inspect.getattr_static(owner, attr)
    if isinstance(fn, (staticmethod, classmethod)):
        raise TypeError(f"{module_name}.{path} is a {type(fn).__name__}; wrap its caller")
    if not getattr(fn, "__megaflow_cpu_compat__", False):
        setattr(owner, attr, wrap(fn))


def cpu_accommodations_needed() -> bool:
    """True when this process has no usable CUDA device (the accommodations apply)."""
    return not torch.cuda.is_available()


def apply_cpu_accommodations() -> bool:
    """Install the CPU accommodations for megatron-core (module docstring); idempotent.

    Call it before building Megatron models or optimizers. Does nothing when CUDA is
    available.

    Returns:
        True when the accommodations are active in this process, False on CUDA.
    """
    global _applied
    if not cpu_accommodations_needed():
        return False
    with _apply_lock:
        if _applied:
            return True
        proxy = _CpuTorch()
        for module_name in _DEVICE_MODULES:
            importlib.import_module(module_name).torch = proxy  # type: ignore[attr-defined]  # the module's torch name
        for module_name, path, _why in _CUDA_TYPE_NAME_FUNCTIONS:
            _patch_type_name_function(module_name, path)
        for module_name, path, _why in _TENSOR_CUDA_FUNCTIONS:
            _patch_type_name_function(module_name, path, _with_tensor_cuda_identity)
        for module_name, name, _why in _CPU_RNG_STATE_FUNCTIONS:
            setattr(importlib.import_module(module_name), name, _no_cuda_rng_state)
        for module_name, name, _why in _TE_ONLY_NAMES:
            module = importlib.import_module(module_name)
            if not hasattr(module, name):
                setattr(module, name, None)
        _applied = True
    return True


#: TransformerConfig fields of accommodation 7: CPU initialisation, no CUDA fusion kernels.
_CPU_TRANSFORMER_CONFIG = dict(
    use_cpu_initialization=True, gradient_accumulation_fusion=False, bias_activation_fusion=False,
    masked_softmax_fusion=False, persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False)


def transformer_config_accommodations() -> dict[str, bool]:
    """``TransformerConfig`` fields for this process: on CPU CPU initialisation and every
    fusion off (accommodation 7); on CUDA none (the caller's GPU defaults stand)."""
    return dict(_CPU_TRANSFORMER_CONFIG) if cpu_accommodations_needed() else {}


def causal_attention_mask(seq_len: int, device: torch.device | str) -> torch.Tensor:
    """Megatron attention mask ``[1, 1, seq, seq]`` (True = masked): causal attention."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def attention_mask_argument(seq_len: int, device: torch.device | str) -> torch.Tensor | None:
    """``GPTModel.forward``'s ``attention_mask`` for causal attention over ``seq_len`` tokens.

    None on CUDA: the layer spec's attention takes the causal mask type (TE's fused or
    flash attention, or the local spec's softmax, which builds its default causal mask on
    the device) and needs no ``[s, s]`` tensor. On CPU :func:`causal_attention_mask`
    (accommodation 6: megatron-core's default mask is built on ``"cuda"``).
    """
    return causal_attention_mask(seq_len, device) if cpu_accommodations_needed() else None


def model_parallel_manual_seed(seed: int) -> None:
    """Seed Megatron's model-parallel RNG (``model_parallel_cuda_manual_seed``) on any device.

    On CUDA this is ``model_parallel_cuda_manual_seed(seed)``: per-TP-rank CUDA RNG
    streams. On CPU (accommodation 4 in the module docstring): ``torch.manual_seed(seed)``
    and Megatron's pass-through RNG tracker, so ``get_cuda_rng_tracker().fork()`` is a no-op.

    Args:
        seed: the base seed (same on every rank; Megatron offsets it per TP rank on CUDA).

    Raises:
        ValueError: if ``seed`` is negative.
    """
    from megatron.core import tensor_parallel

    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not cpu_accommodations_needed():
        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
        return
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(
        seed, inference_rng_tracker=True, force_reset_rng=True)


__all__ = ["apply_cpu_accommodations", "attention_mask_argument", "causal_attention_mask",
           "cpu_accommodations_needed", "model_parallel_manual_seed", "transformer_config_accommodations"]
