"""megaflow's configuration: typed, frozen sections.

``Config`` is the root; every field of the config tree has its default here or in
:mod:`megaflow.config.roles`, and nowhere else: the workers and the Megatron engine receive
this frozen tree with the role's name (a :class:`megaflow.config.role_spec.RoleSpec`), the
loss adapters the tree itself, and they read their sections as they are (the vLLM engine gets
a ``VLLMRolloutConfig`` that its worker fills from ``rollout``). A
recipe (YAML in ``recipes/``) and command-line ``key.sub=value`` overrides are layered
over these defaults by :func:`megaflow.config.load_config`. Each section validates its own
fields on construction; :class:`Config` then validates what spans sections (algorithm vs
roles, parallel sizes vs the model and the resource pools, batch divisibility) through
:func:`megaflow.config.topology.validate_config`. Errors are :class:`ConfigError`
(``ValueError``) naming the full dotted key. Derived sizes (DP sizes, mini-batch and
micro-batch counts) are never stored: pure functions in :mod:`megaflow.config.topology`
compute them from a config.
"""
from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field, fields
from typing import Any, Literal, Mapping, get_args

from megaflow.config.layout import pack_pools
from megaflow.config.roles import (
    GROUP_ESTIMATORS,
    ROLES,
    ActorConfig,
    CriticConfig,
    OptimConfig,
    ParallelConfig,
    RefConfig,
    RewardModelConfig,
    RolloutConfig,
)
from megaflow.config.topology import validate_config
from megaflow.config.typed import ConfigError, Section, check, check_positive

AdvEstimator = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                       "remax"]
KLEstimator = Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"]
#: KL loss kinds: the estimators plus straight-through "+" variants (megaflow.algorithms.kl).
KLLossType = Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "abs+", "k3+", "low_var_kl+"]
Logger = Literal["console", "jsonl", "tensorboard", "wandb"]

ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
KL_LOSS_TYPES: tuple[str, ...] = get_args(KLLossType)
LOGGERS: tuple[str, ...] = get_args(Logger)


@dataclass(frozen=True)
class ModelConfig(Section):
    """The policy's architecture and weights (ref and critic use the same architecture)."""

    path: str | None = None
    """HF checkpoint directory (config.json + safetensors); None: random init from hf_config."""
    hf_config: Mapping[str, Any] | None = None
    """Inline HF config (config.json fields, model_type llama or qwen2). Random-init models
    need it; big-model recipes set it too so a dry run works without weights. When both
    are set and path/config.json exists, their architecture fields must agree."""
    tokenizer: str | None = None
    """HF tokenizer directory, or a built-in tokenizer name ('arith'); None: model.path."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter and compute dtype of training and generation (bf16 on GPUs)."""

    # That path or hf_config is set, and the tokenizer, is checked by Config (topology.py),
    # so that the section's defaults are valid on their own and layer cleanly.


@dataclass(frozen=True)
class DataConfig(Section):
    """Prompt datasets in verl's column layout (``prompt`` chat messages, ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``), from parquet/JSONL files or a built-in
    generated task."""

    train_files: tuple[str, ...] = ()
    """Training prompt files (.parquet or .jsonl); a single path is accepted."""
    val_files: tuple[str, ...] = ()
    """Validation prompt files."""
    task: Literal["arith"] | None = None
    """Built-in generated task used instead of files (megaflow.data.arith)."""
    task_args: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task generator (for 'arith': megaflow.data.arith.ArithTaskConfig)."""
    prompt_key: str = "prompt"
    """Column with the prompt (a list of chat messages, or a string)."""
    max_prompt_length: int = 512
    """Prompt tokens after the chat template; longer prompts are filtered or rejected."""
    filter_overlong_prompts: bool = True
    """Drop (and report) over-long prompts; false: raise an error naming the sample."""
    apply_chat_template: bool = True
    """Render prompts with the tokenizer's chat template."""
    train_batch_size: int = 64
    """Prompts per training step (samples per step = this x rollout.n)."""
    val_batch_size: int | None = None
    """Prompts per validation batch; None: the whole validation set at once."""
    shuffle: bool = True
    """Shuffle the training prompts every epoch."""
    seed: int = 1
    """Seed of the sampler (deterministic, resumable order)."""

    def validate(self) -> None:
        check(not (self.train_files and self.task is not None), "task",
              "set either {0} or {1}, not both", "train_files", "task")
        check_positive(self, "max_prompt_length", "train_batch_size", "val_batch_size")


@dataclass(frozen=True)
class KLControlConfig(Section):
    """Coefficient of the KL penalty in the reward (Ziegler et al. 2019, section 2.2)."""

    type: Literal["fixed", "adaptive"] = "fixed"
    """Fixed coefficient, or adapted towards target_kl over horizon samples."""
    kl_coef: float = 0.001
    """(Initial) coefficient beta."""
    target_kl: float = 0.1
    """Adaptive controller's target KL per token."""
    horizon: int = 10000
    """Adaptive controller's horizon, in samples."""

    def validate(self) -> None:
        check_positive(self, "kl_coef", allow_zero=True)
        check_positive(self, "target_kl", "horizon")


_GEO = {"rs": "seq_mean_k1", "rs_threshold": "0.999_1.001"}
_K3 = {"rs": "seq_mean_k3", "rs_threshold": "0.01"}
_TOKEN_IS, _SEQ_IS = {"is_level": "token"}, {"is_level": "sequence", "is_weight_tokens": "valid"}
_BYPASS_PG = {"bypass": True, "bypass_loss_type": "reinforce"}
#: verl 0.9.1's named rollout-correction presets (RolloutCorrectionConfig class methods, their
#: default thresholds) as values of algorithm.rollout_correction.
ROLLOUT_CORRECTION_PRESETS: dict[str, dict[str, Any]] = {
    "disabled": {}, "decoupled_token_is": _TOKEN_IS, "decoupled_seq_is": {"is_level": "sequence"},
    "decoupled_seq_is_rs": {**_SEQ_IS, "rs": "seq_sum_k1", "rs_threshold": "0.5_2.0"},
    "decoupled_geo_rs": _GEO, "decoupled_geo_rs_seq_tis": {**_SEQ_IS, **_GEO},
    "decoupled_geo_rs_token_tis": {**_TOKEN_IS, **_GEO}, "decoupled_k3_rs": _K3,
    "decoupled_k3_rs_seq_tis": {**_SEQ_IS, **_K3}, "decoupled_k3_rs_token_tis": {**_TOKEN_IS, **_K3},
    "bypass_ppo_clip": {"bypass": True}, "bypass_ppo_clip_geo_rs": {"bypass": True, **_GEO},
    "bypass_ppo_clip_k3_rs": {"bypass": True, **_K3}, "bypass_pg_is": {**_BYPASS_PG, "is_level": "sequence"},
    "bypass_pg_geo_rs": {**_BYPASS_PG, **_GEO}, "bypass_pg_geo_rs_seq_tis": {**_BYPASS_PG, **_SEQ_IS, **_GEO},
    "bypass_pg_geo_rs_token_tis": {**_BYPASS_PG, **_TOKEN_IS, **_GEO},
}


@dataclass(frozen=True)
class RolloutCorrectionConfig(Section):
    """Correction for the gap between the rollout engine's and the trainer's log-probs
    (``megaflow.algorithms.rollout_correction``: formulas and papers).

    ``delta = log pi_old - log pi_rollout`` per valid token. Importance weights multiply the
    actor's per-token policy loss; rejected tokens leave the actor's loss and its global
    token/sequence denominators (the critic still sees every token).
    """

    is_level: Literal["none", "token", "sequence", "geometric"] = "none"
    """Truncated importance weights (TIS): per token exp(delta), per sequence exp(sum delta),
    or the geometric mean exp(mean delta); none disables them."""
    is_threshold: float = 2.0
    """Upper truncation C of the weights (> 0)."""
    rejection: Literal["none", "token", "geometric", "seq_sum", "seq_mean"] = "none"
    """Mask tokens (token: IcePop) or whole sequences (geometric: seq-mask-TIS/MIS; seq_sum /
    seq_mean: bounds on the sum / mean of delta) outside [rejection_lower, rejection_upper]."""
    rejection_lower: float | None = None
    """Lower bound of the accepted band: a ratio (> 0) for token/geometric, a log-ratio for
    seq_sum/seq_mean. Required with a rejection mode."""
    rejection_upper: float | None = None
    """Upper bound of the accepted band (same units as rejection_lower)."""
    rs: str | None = None
    """verl's rollout_rs: rejection options, comma-separated and AND-ed: token_k1|k2|k3,
    seq_sum_k1|k2|k3, seq_mean_k1|k2|k3, seq_max_k2|k3 (k1 = log(pi_rollout / pi_old) per token,
    k2 = delta^2 / 2, k3 = exp(delta) - 1 - delta; megaflow.algorithms.off_policy). Needs
    rs_threshold; excludes rejection."""
    rs_threshold: str | None = None
    """verl's rollout_rs_threshold: one value for every rs option or one per option
    (comma-separated); a k1 entry is 'lower_upper' (ratios) or u meaning [1/u, u], a k2/k3 entry
    an upper bound. A string: quote a single number in YAML ('0.01')."""
    is_batch_normalize: bool = False
    """Divide the truncated weights by their batch mean (token: over valid tokens; sequence,
    geometric: over the rows with valid tokens), verl's rollout_is_batch_normalize."""
    icepop_lower: float | None = None
    """IcePop weight band (with icepop_upper; needs is_level): importance ratios outside
    [icepop_lower, icepop_upper] get weight 0 before truncation; unlike rejection the tokens
    stay in the loss's denominators."""
    icepop_upper: float | None = None
    """Upper end of the IcePop weight band."""
    is_weight_tokens: Literal["kept", "valid"] = "kept"
    """With rejection and sequence/geometric weights: take each row's weight over its kept
    tokens (megaflow) or over every valid token (valid: verl's choice)."""
    reject_scope: Literal["actor", "batch"] = "actor"
    """Where the rejection mask (and the weights) take effect: actor (megaflow) replaces the
    response mask of the actor's update batch only; batch (verl) replaces the step batch's
    response mask before KL-in-reward, advantages (GAE, whitening, group statistics), the
    critic's update and the data metrics, so rejected tokens leave those too."""
    bypass: bool = False
    """Use the rollout's log-probs as the old policy's (pi_old = pi_rollout) and skip the
    old-log-prob forward pass. With is_level (token/sequence), rs or bypass_loss_type=reinforce
    the actor's loss is verl's bypass loss: weights and rejection recomputed inside the loss,
    every micro-batch, from the current vs the rollout log-probs (rejected tokens stay in the
    global denominators). Excludes rejection and the IcePop band."""
    bypass_loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    """Bypass loss: ppo_clip (PPO's clipped surrogate with ratio pi / pi_rollout; no IS weight,
    the ratio is one) or reinforce (-A x log-prob x detached weight). reinforce needs bypass."""
    max_mismatch: float | None = None
    """Stop the run when the step's mean |delta| (nats) exceeds this; null: never."""
    preset: str | None = None
    """One of verl's named presets (ROLLOUT_CORRECTION_PRESETS: decoupled_token_is,
    decoupled_seq_is_rs, decoupled_geo_rs(_seq_tis|_token_tis), decoupled_k3_rs(...),
    bypass_ppo_clip(_geo_rs|_k3_rs), bypass_pg_is, bypass_pg_geo_rs(...), disabled), with verl's
    default thresholds; it sets the keys it names (a different explicit value of one of them is
    refused). Sequence IS with rejection takes verl's is_weight_tokens=valid."""

    def __post_init__(self) -> None:
        if self.preset is not None:
            check(self.preset in ROLLOUT_CORRECTION_PRESETS, "preset",
                  f"unknown preset {self.preset!r}; valid: {', '.join(ROLLOUT_CORRECTION_PRESETS)}")
            defaults = {f.name: f.default for f in fields(self)}
            for key, value in ROLLOUT_CORRECTION_PRESETS[self.preset].items():
                check(getattr(self, key) in (defaults[key], value), key,
                      f"is set by {{0}}={self.preset!r} to {value!r}; remove it or the preset", "preset")
                object.__setattr__(self, key, value)
        super().__post_init__()

    def validate(self) -> None:
        check_positive(self, "is_threshold", "max_mismatch")
        if self.rejection == "none":
            for key in ("rejection_lower", "rejection_upper"):
                check(getattr(self, key) is None, key, "is only used with a rejection mode: set {0} or remove it",
                      "rejection")
        else:
            for key in ("rejection_lower", "rejection_upper"):
                check(getattr(self, key) is not None, key, f"required with {{0}}={self.rejection!r}", "rejection")
            lower, upper = self.rejection_lower, self.rejection_upper
            check(lower <= upper, "rejection_lower", f"must be <= {{0}} ({upper}), got {lower}", "rejection_upper")
            if self.rejection in ("token", "geometric"):
                check(lower > 0, "rejection_lower",
                      f"bounds a ratio with {{0}}={self.rejection!r}: must be > 0, got {lower}", "rejection")
        self._validate_verl_surface()
        check(self.bypass or self.bypass_loss_type == "ppo_clip", "bypass_loss_type", "needs {0}=true", "bypass")
        if self.bypass:
            check(self.is_level in ("none", "token", "sequence"), "is_level",
                  "must be none, token or sequence with {0}=true (verl's bypass weights)", "bypass")
            check(self.icepop_lower is None, "icepop_lower", "is not supported with {0}=true", "bypass")
            check(self.rejection == "none", "rejection",
                  "must be none with {0}=true (use rs: the bypass loss rejects with verl's options)", "bypass")

    def _validate_verl_surface(self) -> None:
        """rs/rs_threshold parse (verl's syntax), the IcePop band, the knobs that need weights."""
        check((self.rs is None) == (self.rs_threshold is None), "rs_threshold",
              "must be set together with {0} (and only with it)", "rs")
        check(self.rs is None or self.rejection == "none", "rs", "excludes {0}: choose one way to reject", "rejection")
        if self.rs is not None:
            from megaflow.algorithms.off_policy import parse_rejection

            try:
                parse_rejection(self.rs, self.rs_threshold)
            except ValueError as err:
                check(False, "rs", str(err))
        band = (self.icepop_lower, self.icepop_upper)
        check((band[0] is None) == (band[1] is None), "icepop_lower", "must be set together with {0}", "icepop_upper")
        if band[0] is not None:
            check(0 < band[0] <= band[1], "icepop_lower", f"needs 0 < lower <= {{0}}, got [{band[0]}, {band[1]}]",
                  "icepop_upper")
        for key, used in (("icepop_lower", band[0] is not None), ("is_batch_normalize", self.is_batch_normalize),
                          ("is_weight_tokens", self.is_weight_tokens != "kept")):
            check(not used or self.is_level != "none", key, "needs importance weights ({0} is none)", "is_level")
        check(self.reject_scope == "actor" or self.rejection != "none" or self.rs is not None, "reject_scope",
              "needs a rejection ({0} or rs)", "rejection")
        check(self.reject_scope == "actor" or not self.bypass, "reject_scope",
              "must be actor with {0}=true (the bypass loss rejects inside the update)", "bypass")

    @property
    def bypass_loss(self) -> bool:
        """Whether the actor's loss is the bypass loss (weights/rejection inside the loss)."""
        return self.bypass and (self.is_level != "none" or self.rs is not None or self.bypass_loss_type != "ppo_clip")

    @property
    def active(self) -> bool:
        """Whether weights or rejection change the actor's update."""
        return self.is_level != "none" or self.rejection != "none" or self.rs is not None


@dataclass(frozen=True)
class AlgorithmConfig(Section):
    """Advantage estimation and KL regularisation (megaflow.algorithms)."""

    adv_estimator: AdvEstimator = "grpo"
    """gae (PPO with a critic), grpo, dr_grpo, rloo, reinforce_plus_plus(_baseline), remax."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group std (dr_grpo never does)."""
    use_kl_in_reward: bool = False
    """Subtract kl_ctrl.kl_coef x KL(old || ref) from the token rewards."""
    kl_penalty: KLEstimator = "k1"
    """KL estimator of the reward penalty."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    """Controller of the reward-penalty coefficient."""
    use_kl_loss: bool = False
    """Add kl_loss_coef x KL(actor || ref) to the actor's loss (GRPO style)."""
    kl_loss_coef: float = 0.001
    """Coefficient of the KL loss."""
    kl_loss_type: KLLossType = "low_var_kl"
    """KL estimator of the loss term ("+": straight-through gradient of k2)."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Importance weights / rejection for the rollout-vs-trainer log-prob gap, bypass mode."""

    def validate(self) -> None:
        check(0.0 <= self.gamma <= 1.0, "gamma", f"must lie in [0, 1], got {self.gamma}")
        check(0.0 <= self.lam <= 1.0, "lam", f"must lie in [0, 1], got {self.lam}")
        check_positive(self, "kl_loss_coef", allow_zero=True)

    @property
    def uses_ref(self) -> bool:
        """Whether reference log-probs are needed (KL in the reward or in the loss)."""
        return self.use_kl_in_reward or self.use_kl_loss


@dataclass(frozen=True)
class RewardConfig(Section):
    """Rule-based rewards, chosen by each sample's ``data_source`` (megaflow.rewards)."""

    functions: Mapping[str, str] = field(default_factory=dict)
    """data_source -> 'package.module:function' scorer registered for that source (verl's
    compute_score signature). Built-in sources (gsm8k, openai/gsm8k, arith, countdown)
    need no entry."""
    reward_kwargs: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """data_source -> keyword arguments of its scorer (e.g. {openai/gsm8k: {method: flexible}})."""
    format_weight: float = 0.0
    """Weight w of the format reward: score = (1 - w) * task + w * format; 0 disables it."""
    format_pattern: str | None = None
    """Regex the format reward checks; null: megaflow.rewards.format's default pattern."""

    def validate(self) -> None:
        check(0.0 <= self.format_weight <= 1.0, "format_weight", f"must lie in [0, 1], got {self.format_weight}")
        for source, target in self.functions.items():
            module, _, name = target.partition(":")
            check(bool(module) and name.isidentifier(), f"functions.{source}",
                  f"expected 'package.module:function', got {target!r}")
        if self.format_pattern is not None:
            try:
                re.compile(self.format_pattern)
            except re.error as err:
                raise ConfigError("format_pattern", f"invalid regular expression {self.format_pattern!r}: {err}") from None


@dataclass(frozen=True)
class TrainerConfig(Section):
    """The controller loop: length, cadence, output, logging."""

    total_epochs: int = 1
    """Passes over the training prompts (used when total_steps is null)."""
    total_steps: int | None = None
    """Training steps; null: total_epochs x steps per epoch (topology.num_training_steps)."""
    save_freq: int = 0
    """Save a checkpoint every N steps and after the last; 0: only after the last; -1: never."""
    test_freq: int = 0
    """Validate every N steps and after the last; 0: never."""
    val_before_train: bool = False
    """Validate once before the first step."""
    balance_batch: bool = False
    """Reorder each step's samples so every actor DP rank gets about the same number of tokens
    (sequence-length balancing); changes which samples share a mini-batch."""
    output_dir: str = "outputs"
    """Root of run directories: <output_dir>/<project_name>/<experiment_name>."""
    resume: str = "auto"
    """'disable', 'auto' (latest complete checkpoint of the run directory, if any) or a path."""
    resume_ignore_config_diff: bool = False
    """Resume although the config differs from the checkpoint's config.yaml in keys that
    change the run (megaflow.trainer.resume.RESUME_MAY_DIFFER lists those that may differ)."""
    max_ckpt_to_keep: int | None = None
    """Keep only the newest N checkpoints; null keeps all."""
    export_hf: bool = False
    """Export the final actor to HF format (<run dir>/hf) at the end."""
    seed: int = 1
    """Seed of model init, sampling and shuffling."""
    logger: tuple[Logger, ...] = ("console", "jsonl")
    """Metric sinks: console, jsonl, tensorboard, wandb."""
    console_every: int = 10
    """With the console logger: a short line of key figures every N steps (and after the
    last); 0: only the progress bar. Every metric goes to the other sinks every step."""
    project_name: str = "megaflow"
    """Project (directory level and wandb project)."""
    experiment_name: str = "default"
    """Experiment (run directory and wandb run); load_config sets it to the recipe name."""
    async_rollout: bool = False
    """One-step-off asynchronous training: batch k+1 is generated with the weights of step k
    on the rollout pool while the actor trains on batch k. Needs split placement
    (resources.placement.rollout); turns on token-level rollout correction
    (algorithm.rollout_correction.is_level=token) unless that section chooses a mode."""
    max_staleness: int = 1
    """Largest accepted age of a sample, in actor versions (updates), when the actor trains
    on it; enforced per sample in async_rollout mode (which needs >= 1)."""

    def validate(self) -> None:
        check_positive(self, "total_epochs", "total_steps", "max_ckpt_to_keep")
        check(self.save_freq >= -1, "save_freq", f"must be >= -1, got {self.save_freq}")
        check_positive(self, "test_freq", "console_every", "max_staleness", allow_zero=True)
        check(not self.async_rollout or self.max_staleness >= 1, "max_staleness",
              f"{{0}}=true generates each batch one actor version ahead: needs >= 1, got {self.max_staleness}",
              "async_rollout")
        check(len(set(self.logger)) == len(self.logger), "logger", f"duplicate entries in {list(self.logger)}")
        check(self.resume.strip() != "", "resume", "must be 'disable', 'auto' or a checkpoint path")
        for name in ("project_name", "experiment_name"):
            value = getattr(self, name)
            check(value != "" and "/" not in value and value not in (".", ".."), name,
                  f"must be a non-empty name without '/', got {value!r}")


@dataclass(frozen=True)
class PoolConfig(Section):
    """One resource pool: ``nodes`` nodes with ``procs_per_node`` ranks each."""

    nodes: int | None = None
    """Nodes of the pool; null: resources.nodes."""
    procs_per_node: int | None = None
    """Ranks per node (one per GPU on GPU machines); null: resources.procs_per_node."""

    def validate(self) -> None:
        check_positive(self, "nodes", "procs_per_node")


@dataclass(frozen=True)
class PlacementConfig(Section):
    """Role -> pool name. Roles on the same pool share its processes (colocated in one
    process per rank); a role on its own pool runs in its own processes. The rollout lives
    in the actor's processes (3D-HybridEngine) unless ``rollout`` names another pool
    (split placement: weights travel from the actor to the rollout ranks each sync)."""

    actor: str = "global"
    """Pool of the actor (and its rollout)."""
    ref: str = "global"
    """Pool of the reference policy (read only when ref.enabled)."""
    critic: str = "global"
    """Pool of the critic (read only when critic.enabled)."""
    reward_model: str = "global"
    """Pool of the reward model (read only when reward_model.enabled)."""
    rollout: str | None = None
    """Pool of the rollout engines; null: the actor's pool (colocated). Another pool: split
    placement, the pool's ranks hold only engines (TP = rollout.tp, ranks a multiple of it)
    and the actor broadcasts its generation shards to them on every weight sync."""


@dataclass(frozen=True)
class ResourcesConfig(Section):
    """The cluster and how it is split into resource pools."""

    nodes: int = 1
    """Nodes of the cluster."""
    procs_per_node: int = 2
    """Ranks per node: the GPUs per node when use_gpu, otherwise CPU processes."""
    use_gpu: bool | None = None
    """Run on GPUs; null: auto (true when nvidia-smi is on PATH), resolved on load."""
    num_cpus_per_proc: int = 1
    """CPUs reserved per rank (Ray bundle num_cpus), and the rank's torch intra-op threads (one per CPU)."""
    gpu_memory_gib: float = 80.0
    """Memory of one GPU, for the planner's fit check."""
    cpu_memory_gib: float | None = None
    """Host memory per node, for the planner's fit check on CPU; null: not checked."""
    pools: Mapping[str, PoolConfig] = field(default_factory=lambda: {"global": PoolConfig()})
    """Resource pools, laid out on the cluster's nodes in this order (first fit)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Which pool each role runs on."""

    def __post_init__(self) -> None:
        if self.use_gpu is None:
            object.__setattr__(self, "use_gpu", shutil.which("nvidia-smi") is not None)
        super().__post_init__()

    def validate(self) -> None:
        check_positive(self, "nodes", "procs_per_node", "num_cpus_per_proc", "gpu_memory_gib", "cpu_memory_gib")
        check(len(self.pools) > 0, "pools", "at least one pool is needed")
        # The roles' pools are checked with the config (topology.validate_config): a disabled
        # role's placement is never read, so it need not name a pool.
        rollout = self.placement.rollout
        check(rollout is None or rollout in self.pools, "placement.rollout",
              f"unknown pool {rollout!r}; pools: {', '.join(self.pools)} (null: the actor's pool)")
        pack_pools(self)  # raises ConfigError at resources.pools.<name> when they do not fit

    def pool_nodes(self, name: str) -> int:
        """Nodes of pool ``name`` (its own value or the cluster's)."""
        return self.pools[name].nodes or self.nodes

    def pool_procs_per_node(self, name: str) -> int:
        """Ranks per node of pool ``name``."""
        return self.pools[name].procs_per_node or self.procs_per_node

    def pool_world_size(self, name: str) -> int:
        """Ranks of pool ``name``."""
        return self.pool_nodes(name) * self.pool_procs_per_node(name)


@dataclass(frozen=True)
class RayConfig(Section):
    """The Ray cluster the controller attaches to or starts."""

    address: str | None = None
    """Existing cluster ('auto' or host:port); null: start a local Ray instance."""
    num_cpus: int | None = None
    """CPUs of a locally started Ray; null: Ray's detection."""
    namespace: str = "megaflow"
    """Ray namespace of the run's actors."""
    include_dashboard: bool = False
    """Start Ray's dashboard with a local instance."""
    dashboard_host: str = "127.0.0.1"
    """Interface the dashboard binds to (localhost by default, never all interfaces)."""
    resource_wait_timeout_s: float = 300.0
    """Wait at most this long for the cluster to offer the pools' resources, then fail
    with what is needed and what joined."""

    def validate(self) -> None:
        check_positive(self, "num_cpus", "resource_wait_timeout_s")


@dataclass(frozen=True)
class Config(Section):
    """The whole run. Construct through :func:`megaflow.config.load_config`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """Architecture, weights, tokenizer, dtype."""
    data: DataConfig = field(default_factory=DataConfig)
    """Prompt datasets and lengths."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage estimator and KL."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Generation."""
    ref: RefConfig = field(default_factory=RefConfig)
    """Reference policy."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model (PPO with GAE)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Learned reward model."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rule-based rewards."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Controller loop."""
    resources: ResourcesConfig = field(default_factory=ResourcesConfig)
    """Cluster and pools."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Ray cluster."""

    def validate(self) -> None:
        validate_config(self)
        if self.actor.on_policy_old_log_probs:
            _check_on_policy_update(self)
        check(not self.algorithm.rollout_correction.bypass_loss or self.actor.policy_loss == "ppo",
              "actor.policy_loss", "must be ppo when {0} makes the actor's loss the bypass loss (weights, rs or "
              "reinforce with bypass=true)", "algorithm.rollout_correction.bypass")


def _check_on_policy_update(cfg: Config) -> None:
    """``actor.on_policy_old_log_probs`` needs an update that is on-policy by construction
    (one epoch, one mini-batch of the whole step) and no stage that reads the old log-probs
    before the update.

    Raises:
        ConfigError: at the key that breaks it.
    """
    key, actor, algo = "actor.on_policy_old_log_probs", cfg.actor, cfg.algorithm
    check(actor.ppo_epochs == 1, "actor.ppo_epochs",
          f"must be 1 with {{0}}=true (a second epoch sees updated weights), got {actor.ppo_epochs}", key)
    check(actor.ppo_mini_batch_size == cfg.data.train_batch_size, "actor.ppo_mini_batch_size",
          f"must equal data.train_batch_size={cfg.data.train_batch_size} with {{0}}=true (one mini-batch, "
          f"so no optimizer step comes before a later mini-batch's forward), got {actor.ppo_mini_batch_size}", key)
    check(not algo.use_kl_in_reward, "algorithm.use_kl_in_reward",
          "must be false with {0}=true (the reward's KL reads the old log-probs before the update)", key)
    rc = algo.rollout_correction
    for sub in ("is_level", "rejection"):
        check(getattr(rc, sub) == "none", f"algorithm.rollout_correction.{sub}",
              "must be none with {0}=true (it reads the old log-probs before the update)", key)
    check(rc.rs is None, "algorithm.rollout_correction.rs",
          "must be null with {0}=true (it reads the old log-probs before the update)", key)
    check(rc.max_mismatch is None, "algorithm.rollout_correction.max_mismatch",
          "must be null with {0}=true (it reads the old log-probs before the update)", key)
    check(not rc.bypass, "algorithm.rollout_correction.bypass",
          "excludes {0}=true: choose one source of the old log-probs", key)
    check(not cfg.trainer.async_rollout, "trainer.async_rollout",
          "must be false with {0}=true (one step off corrects with importance weights from the old log-probs)", key)


__all__ = [
    "Config", "ModelConfig", "DataConfig", "AlgorithmConfig", "KLControlConfig", "RolloutCorrectionConfig",
    "ActorConfig", "OptimConfig",
    "ParallelConfig", "RolloutConfig", "RefConfig", "CriticConfig", "RewardModelConfig", "RewardConfig",
    "TrainerConfig", "ResourcesConfig", "PoolConfig", "PlacementConfig", "RayConfig", "ConfigError",
    "ADV_ESTIMATORS", "GROUP_ESTIMATORS", "KL_ESTIMATORS", "KL_LOSS_TYPES", "LOGGERS", "ROLES",
]
