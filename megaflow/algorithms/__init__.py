"""Pure RL math of PPO-family post-training: masks, advantages, KL, losses, aggregation.

Every function here is a pure torch function on ``[batch, response_len]`` tensors: no
``torch.distributed``, no global state. Anything that depends on how a mini-batch was
split over DP ranks and micro-batches enters as an argument (global denominators: valid
tokens and sequences, all-reduced over DP by the caller), so results are
split-invariant.
"""
from megaflow.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    compute_advantages,
    discounted_returns,
    masked_gae,
)
from megaflow.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss
from megaflow.algorithms.grouping import GroupStats, group_index, group_stats
from megaflow.algorithms.kl import (
    KL_CONTROLLERS,
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    build_kl_controller,
    kl_loss,
    kl_penalty,
)
from megaflow.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megaflow.algorithms.policy_loss import (
    cispo_policy_loss,
    clipped_surrogate,
    entropy_bonus,
    entropy_from_logits,
    gspo_policy_loss,
    ppo_policy_loss,
)
from megaflow.algorithms.policy_loss_family import (
    POLICY_LOSSES,
    clip_cov_policy_loss,
    compute_policy_loss,
    dppo_kl_policy_loss,
    dppo_tv_policy_loss,
    dro_policy_loss,
    geo_mean_policy_loss,
    gpg_policy_loss,
    kl_cov_policy_loss,
    sapo_policy_loss,
)
from megaflow.algorithms.response_mask import compute_response_mask, response_lengths
from megaflow.algorithms.rollout_correction import (
    IS_LEVELS,
    REJECTION_MODES,
    importance_weights,
    rejection_mask,
    rollout_correction_metrics,
)
from megaflow.algorithms.routing_agreement import routing_agreement
from megaflow.algorithms.value_loss import clipped_value_loss

__all__ = [
    "cispo_policy_loss",
    "clip_cov_policy_loss",
    "dppo_kl_policy_loss",
    "dppo_tv_policy_loss",
    "dro_policy_loss",
    "geo_mean_policy_loss",
    "gpg_policy_loss",
    "kl_cov_policy_loss",
    "sapo_policy_loss",
    "IS_LEVELS",
    "REJECTION_MODES",
    "importance_weights",
    "rejection_mask",
    "rollout_correction_metrics",
    "routing_agreement",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "AdvantageInputs",
    "compute_advantages",
    "discounted_returns",
    "masked_gae",
    "LOSS_AGG_MODES",
    "aggregate_loss",
    "GroupStats",
    "group_index",
    "group_stats",
    "KL_CONTROLLERS",
    "KL_KINDS",
    "AdaptiveKLController",
    "FixedKLController",
    "apply_kl_penalty",
    "build_kl_controller",
    "kl_loss",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "POLICY_LOSSES",
    "clipped_surrogate",
    "compute_policy_loss",
    "entropy_bonus",
    "entropy_from_logits",
    "gspo_policy_loss",
    "ppo_policy_loss",
    "compute_response_mask",
    "response_lengths",
    "clipped_value_loss",
]
