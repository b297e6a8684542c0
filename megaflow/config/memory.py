"""Per-rank memory estimates for the dry-run planner (bytes; rough by design).

Sources and assumptions, per term:

* **Parameters**: exact counts per pipeline stage by formula
  (:func:`megaflow.config.model_spec.stage_parameters`), times the dtype's bytes.
* **Gradients and optimizer state**: megatron-core's bytes per parameter
  (Megatron-LM ``docs/source/api-guide/dist_optimizer.md``): gradients are accumulated in
  fp32 (4 bytes); Adam keeps two fp32 moments (8 bytes) plus an fp32 master copy
  (4 bytes) when the parameters are 16-bit. With the distributed optimizer the optimizer
  state is sharded over the ``dp * cp`` ranks (ZeRO-1, Rajbhandari et al. 2020): bf16
  training costs ``2 + 4 + 12 / (dp*cp)`` bytes per parameter, fp32 ``4 + 4 + 8 / (dp*cp)``.
* **Activations** per transformer layer and micro-batch, Korthikanti et al. 2022
  ("Reducing Activation Recomputation in Large Transformer Models"), section 4, Table 2,
  for 16-bit activations: ``s*b*h*(10 + 24/t + 5*a*s/(h*t))`` without sequence
  parallelism, ``s*b*h*(34/t + 5*a*s/(h*t))`` with it; selective recomputation (and a
  fused/flash attention, assumed on GPUs) removes the ``5*a*s/(h*t)`` score term; full
  recomputation keeps only each layer's input, ``2*s*b*h`` (``/t`` with sequence
  parallelism). ``s`` is divided by ``cp``; fp32 activations double the bytes. The formula
  is for a GPT layer with a 4h GELU MLP and multi-head attention; SwiGLU/GQA models differ
  by a few tens of percent. With 1F1B the first stage holds ``min(pp, micro-batches)``
  micro-batches of its ``L/pp`` layers (section 4.2.3), times ``1 + (pp-1)/(pp*vpp)`` with
  the interleaved schedule. The last stage also holds fp32 logits and their gradient,
  ``2 * 4 * b*s*V/t`` bytes. Forward-only passes (log-probs, ref, values, reward) keep one
  layer's activations plus the logits.
* **KV cache**: ``2 * layers * kv_heads * head_dim * bytes`` per token (K and V), per
  generation rank ``kv_heads / t_g`` heads and ``layers / p_g`` layers.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaflow.config.model_spec import ModelSpec, padded_vocab_size, stage_parameters

GIB = 1024 ** 3
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GRAD_BYTES = 4


def optimizer_bytes_per_param(dtype: str) -> int:
    """Adam state per parameter: 2 fp32 moments, plus an fp32 master copy for 16-bit params."""
    return 8 if DTYPE_BYTES[dtype] == 4 else 12


def activation_bytes_per_layer(*, seq: int, micro_batch: int, hidden: int, heads: int, tp: int,
                               sequence_parallel: bool, recompute: str, fused_attention: bool,
                               dtype: str) -> float:
    """Stored activations of one transformer layer for one micro-batch (Korthikanti et al.
    2022, Table 2; see the module docstring). ``seq`` is the per-rank sequence length."""
    sbh = seq * micro_batch * hidden
    scale = DTYPE_BYTES[dtype] / 2  # the paper's coefficients are for 16-bit activations
    sp = sequence_parallel and tp > 1
    if recompute == "full":
        return scale * 2 * sbh / (tp if sp else 1)
    core = 34 / tp if sp else 10 + 24 / tp
    scores = 0.0 if (recompute == "selective" or fused_attention) else 5 * heads * seq / (hidden * tp)
    return scale * sbh * (core + scores)


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


def role_memory(role: str, spec: ModelSpec, shape: ParallelShape, *, dtype: str, trained: bool,
                distributed_optimizer: bool, fused_attention: bool, head: str,
                offload: tuple[bool, bool, bool] = (False, False, False)) -> RoleMemory:
    """Per-rank memory of ``role`` (the maximum over its pipeline stages).

    Args:
        trained: the role has gradients and an optimizer (actor, critic).
        head: ``"lm"`` (vocabulary logits) or ``"value"`` (scalar head).
        offload: (param, grad, optimizer) offload flags of the role.
    """
    per_stage = stage_parameters(spec, shape.tp, shape.pp, head=head)
    stage_params = [n * DTYPE_BYTES[dtype] for n in per_stage]
    n_params = max(per_stage)
    seq = -(-shape.seq // shape.cp)
    layer_act = activation_bytes_per_layer(
        seq=seq, micro_batch=shape.micro_batch, hidden=spec.hidden_size, heads=spec.num_attention_heads,
        tp=shape.tp, sequence_parallel=shape.sequence_parallel,
        recompute=shape.recompute if trained else "none", fused_attention=fused_attention, dtype=dtype)
    vocab = padded_vocab_size(spec.vocab_size, shape.tp) if head == "lm" else 1
    logits = logits_bytes(seq=seq, micro_batch=shape.micro_batch, vocab=vocab, tp=shape.tp if head == "lm" else 1,
                          backward=trained)
    if trained:
        layers = spec.num_layers // shape.pp
        in_flight = min(shape.pp, shape.num_micro_batches)
        if shape.vpp:
            in_flight *= 1 + (shape.pp - 1) / (shape.pp * shape.vpp)
        first = in_flight * layers * layer_act + (logits if shape.pp == 1 else 0)
        last = layers * layer_act + logits
        activations = max(first, last)
        shards = shape.dp * shape.cp if distributed_optimizer else 1
        grads = n_params * GRAD_BYTES
        optimizer = n_params * optimizer_bytes_per_param(dtype) / shards
    else:
        activations, grads, optimizer = layer_act + logits, 0.0, 0.0
    return RoleMemory(role=role, params=max(stage_params), grads=grads, optimizer=optimizer,
                      activations=activations, param_offload=offload[0], grad_offload=offload[1],
                      optimizer_offload=offload[2])


def kv_bytes_per_token(spec: ModelSpec, gen_tp: int, gen_pp: int, dtype: str) -> float:
    """KV cache per token on one generation rank: ``2 * (L/p_g) * (g/t_g) * d * bytes``."""
    return 2 * (spec.num_layers / gen_pp) * (spec.num_key_value_heads / gen_tp) * spec.head_dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class RolloutMemory:
    """Per-rank bytes of generation in the HybridEngine."""

    weights: float
    """Generation shard (TP = t_g, PP = p_g); the rank's training shard lies inside it."""
    extra_weights: float
    """Generation shard minus the training shard: the all-gathered part."""
    kv_per_sequence: float
    """KV cache of one sample at full length (prompt + response)."""
    kv_needed: float
    """KV cache to hold every sample of one replica at full length at once."""
    kv_reserved: float
    """KV cache the engine reserves: cpu_kv_cache_gib on CPU; on GPU vLLM's budget
    (gpu_memory_utilization x GPU memory) minus the weights."""

    @property
    def peak(self) -> float:
        return self.weights + self.kv_reserved


def rollout_memory(spec: ModelSpec, *, train_tp: int, train_pp: int, gen_tp: int, gen_pp: int, dtype: str,
                   seq: int, samples_per_replica: int, engine_budget: float | None,
                   cpu_kv_cache: float | None) -> RolloutMemory:
    """Generation memory per rank.

    Args:
        engine_budget: GPU: bytes vLLM may reserve for weights + KV (None on CPU).
        cpu_kv_cache: CPU: bytes of KV cache per process (None on GPU).
    """
    bytes_ = DTYPE_BYTES[dtype]
    weights = max(stage_parameters(spec, gen_tp, gen_pp)) * bytes_
    train = max(stage_parameters(spec, train_tp, train_pp)) * bytes_
    per_seq = kv_bytes_per_token(spec, gen_tp, gen_pp, dtype) * seq
    reserved = cpu_kv_cache if engine_budget is None else max(engine_budget - weights, 0.0)
    return RolloutMemory(weights=weights, extra_weights=max(weights - train, 0.0), kv_per_sequence=per_seq,
                         kv_needed=per_seq * samples_per_replica, kv_reserved=reserved)
