"""Advantage estimators behind one uniform signature.

The controller calls :func:`compute_advantages` with every input it has; each estimator
reads what it needs and ignores the rest, so switching estimators is a config change
with no special case in the trainer. :data:`ADVANTAGE_ESTIMATORS` maps each name to an
:class:`AdvantageEstimator` whose ``requires`` says which optional inputs it needs
(``"values"`` means a critic must run; ``"baseline_rewards"`` a greedy rollout).

Conventions shared by all estimators (shapes ``[batch, response_len]``):

* Only valid tokens (``response_mask`` non-zero) receive advantage and returns; both
  are exactly 0 elsewhere. Rewards and values at masked positions are never read.
* Masked tokens *between* valid ones (observation/tool tokens of a multi-turn
  response) are skipped by the return chains of GAE, REINFORCE++ and ReMax: the next
  valid token follows directly, its value bootstraps across the gap, and the discount
  ``gamma`` is applied once per valid step, not per position.
* Outcome estimators (GRPO, Dr. GRPO, RLOO, REINFORCE++-baseline) score a sequence by
  the sum of its valid ``token_level_rewards`` and group rows by ``group_ids``. Empty
  responses (mask sum 0) are excluded from group statistics, so they never change a
  sibling's advantage. A group with fewer than two valid rows, or whose valid scores
  are all equal, has no relative signal: its advantage is exactly 0 (not
  ``score / epsilon`` noise).
* ``returns`` are the critic's regression targets for GAE; the other estimators have
  no critic and return their advantage-like quantity documented per estimator.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from megaflow.algorithms._checks import check_choice, check_same_shape, check_tensor
from megaflow.algorithms.grouping import group_index, group_stats
from megaflow.algorithms.masked import masked_whiten


@dataclass(frozen=True)
class AdvantageInputs:
    """Validated inputs of every estimator (see :func:`compute_advantages`).

    ``response_mask`` is a 0/1 float tensor of the rewards' dtype; rewards and values are
    0 at masked positions (whatever the caller had there). ``valid_rows`` is the
    ``[batch]`` bool "has at least one valid token", ``group_index`` is the dense
    ``[batch]`` int64 group index (or None when no ``group_ids`` were given).
    """

    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    values: torch.Tensor | None
    group_index: torch.Tensor | None
    baseline_rewards: torch.Tensor | None
    gamma: float
    lam: float
    norm_by_std: bool
    epsilon: float

    @property
    def valid_rows(self) -> torch.Tensor:
        return self.response_mask.sum(dim=-1) > 0

    def sequence_scores(self) -> torch.Tensor:
        """``[batch]`` sum of valid token rewards per sequence."""
        return (self.token_level_rewards * self.response_mask).sum(dim=-1)


Estimator = Callable[[AdvantageInputs], "tuple[torch.Tensor, torch.Tensor]"]


def _given(value: torch.Tensor | None, name: str) -> torch.Tensor:
    """An optional input the estimator ``requires`` (present: :func:`compute_advantages` checked it)."""
    if value is None:
        raise ValueError(f"{name!r} is required by this advantage estimator")
    return value


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered estimator: ``fn(inputs) -> (advantages, returns)``.

    ``requires`` names the optional arguments of :func:`compute_advantages` that the
    estimator cannot work without (subset of ``values``, ``group_ids``,
    ``baseline_rewards``).
    """

    name: str
    fn: Estimator
    requires: tuple[str, ...]


def masked_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> torch.Tensor:
    """GAE(gamma, lambda) advantages over valid tokens only, ``[batch, response_len]``.

    Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", eq. 16: ``A_t = sum_l (gamma*lam)^l delta_{t+l}`` with
    ``delta_t = r_t + gamma * V_{t+1} - V_t``, computed backwards as
    ``A_t = delta_t + gamma*lam*A_{t+1}``. Here ``t+1`` is the next *valid* position (masked
    positions are skipped, never read); after the last valid token ``V = 0``, ``A = 0``.
    With ``values = 0`` and ``lam = 1`` this is the discounted return-to-go.
    """
    valid = mask != 0
    batch, length = rewards.shape
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(batch)
    next_advantage = rewards.new_zeros(batch)
    for t in reversed(range(length)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        valid_t = valid[:, t]
        advantages[:, t] = torch.where(valid_t, advantage, torch.zeros_like(advantage))
        next_advantage = torch.where(valid_t, advantage, next_advantage)
        next_value = torch.where(valid_t, values[:, t], next_value)
    return advantages


def discounted_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Return-to-go ``G_t = r_t + gamma * G_{t+1}`` over valid tokens, ``[batch, response_len]``."""
    return masked_gae(rewards, torch.zeros_like(rewards), mask, gamma, 1.0)


def _broadcast(per_row: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_row.unsqueeze(-1) * mask


def _gae(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO with a critic: GAE advantages (batch-whitened when ``norm_by_std``); returns = A + V."""
    mask, values = inputs.response_mask, _given(inputs.values, "values")
    advantages = masked_gae(inputs.token_level_rewards, values, mask, inputs.gamma, inputs.lam)
    returns = (advantages + values) * mask
    if inputs.norm_by_std:
        advantages = masked_whiten(advantages, mask, epsilon=inputs.epsilon)
    return advantages, returns


def _grpo_like(inputs: AdvantageInputs, norm_by_std: bool) -> tuple[torch.Tensor, torch.Tensor]:
    scores = inputs.sequence_scores()
    stats = group_stats(scores, inputs.valid_rows, _given(inputs.group_index, "group_ids"))
    centred = scores - stats.mean
    if norm_by_std:
        centred = centred / (stats.std + inputs.epsilon)
    per_row = torch.where(stats.constant | ~inputs.valid_rows, torch.zeros_like(centred), centred)
    advantages = _broadcast(per_row, inputs.response_mask)
    return advantages, advantages.clone()


def _grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO outcome advantage, Shao et al. 2024 (DeepSeekMath), Sec. 4.1.2.

    ``A_i = (s_i - mean_g(s)) / (std_g(s) + epsilon)`` (unbiased std; without the division
    when ``norm_by_std`` is False), broadcast to every valid token. returns = advantages.
    """
    return _grpo_like(inputs, inputs.norm_by_std)


def _dr_grpo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Dr. GRPO, Liu et al. 2025, "Understanding R1-Zero-Like Training" (arXiv:2503.20783).

    ``A_i = s_i - mean_g(s)``: never divided by the group std (the std term biases the
    update towards too easy/too hard questions); ``norm_by_std`` is ignored. Pair it
    with ``loss_agg_mode="seq-mean-token-sum-norm"`` for the full Dr. GRPO objective.
    """
    return _grpo_like(inputs, False)


def _rloo(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO: Kool et al. 2019 ("Buy 4 REINFORCE samples"), Ahmadian et al. 2024 ("Back to Basics").

    ``A_i = s_i - (sum_{j in g, j != i} s_j) / (n_g - 1)`` over the valid rows of the group,
    broadcast to valid tokens; 0 when ``n_g < 2``. returns = advantages.
    """
    scores = inputs.sequence_scores()
    stats = group_stats(scores, inputs.valid_rows, _given(inputs.group_index, "group_ids"))
    leave_one_out = (stats.sum - scores) / (stats.count - 1).clamp_min(1)
    per_row = scores - leave_one_out
    per_row = torch.where(stats.constant | ~inputs.valid_rows, torch.zeros_like(per_row), per_row)
    advantages = _broadcast(per_row, inputs.response_mask)
    return advantages, advantages.clone()


def _reinforce_plus_plus(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++, Hu 2025 (arXiv:2501.03262), token-level return with global normalisation.

    ``G_t = sum_{k >= t} gamma^(k-t) r_k`` over valid tokens (the KL penalty is expected in
    ``token_level_rewards``); advantages = batch-whitened ``G`` when ``norm_by_std``
    (``G`` itself otherwise); returns = ``G``.
    """
    returns = discounted_returns(inputs.token_level_rewards, inputs.response_mask, inputs.gamma)
    advantages = returns
    if inputs.norm_by_std:
        advantages = masked_whiten(returns, inputs.response_mask, epsilon=inputs.epsilon)
    return advantages, returns


def _reinforce_plus_plus_baseline(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with baseline, Hu 2025 (arXiv:2501.03262, v3+ "REINFORCE++-baseline").

    ``a_i = s_i - mean_g(s)`` (0 for groups without relative signal), broadcast to valid
    tokens, then whitened over the whole batch when ``norm_by_std``. returns = the
    un-whitened ``a_i`` broadcast.
    """
    centred, _ = _grpo_like(inputs, False)
    advantages = centred
    if inputs.norm_by_std:
        advantages = masked_whiten(centred, inputs.response_mask, epsilon=inputs.epsilon)
    return advantages, centred


def _remax(inputs: AdvantageInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax, Li et al. 2023 (arXiv:2310.10505), Algorithm 1: greedy-rollout baseline.

    ``A_t = G_t - b`` with ``G_t`` the discounted return-to-go over valid tokens and ``b``
    the reward of the greedy response to the same prompt (``baseline_rewards[batch]``).
    returns = ``G``.
    """
    mask = inputs.response_mask
    returns = discounted_returns(inputs.token_level_rewards, mask, inputs.gamma)
    advantages = (returns - _given(inputs.baseline_rewards, "baseline_rewards").unsqueeze(-1)) * mask
    return advantages, returns


ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {
    e.name: e
    for e in (
        AdvantageEstimator("gae", _gae, ("values",)),
        AdvantageEstimator("grpo", _grpo, ("group_ids",)),
        AdvantageEstimator("dr_grpo", _dr_grpo, ("group_ids",)),
        AdvantageEstimator("rloo", _rloo, ("group_ids",)),
        AdvantageEstimator("reinforce_plus_plus", _reinforce_plus_plus, ()),
        AdvantageEstimator("reinforce_plus_plus_baseline", _reinforce_plus_plus_baseline, ("group_ids",)),
        AdvantageEstimator("remax", _remax, ("baseline_rewards",)),
    )
}


def _check_required(spec: AdvantageEstimator, provided: dict[str, Any]) -> None:
    for name in spec.requires:
        if provided[name] is None:
            raise ValueError(f"advantage estimator {spec.name!r} requires {name!r}, which was not given")


def _zero_invalid(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.where(valid, x.detach(), torch.zeros_like(x))


def _check_rate(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def compute_advantages(
    estimator: str,
    *,
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    group_ids: Sequence[Any] | np.ndarray | torch.Tensor | None = None,
    baseline_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    norm_by_std: bool = True,
    epsilon: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Compute ``(advantages, returns)`` with the named estimator (see module docs).

    Args:
        estimator: a key of :data:`ADVANTAGE_ESTIMATORS`: ``"gae"``, ``"grpo"``,
            ``"dr_grpo"``, ``"rloo"``, ``"reinforce_plus_plus"``,
            ``"reinforce_plus_plus_baseline"``, ``"remax"``.
        token_level_rewards: ``[batch, response_len]`` float rewards (scores minus any KL
            penalty); outcome rewards usually sit on the last valid token.
        response_mask: ``[batch, response_len]``, non-zero = token generated by the policy.
        values: ``[batch, response_len]`` critic values (``"gae"``).
        group_ids: ``[batch]`` uids (numpy object array, list or tensor); equal ids form a
            group (``"grpo"``, ``"dr_grpo"``, ``"rloo"``, ``"reinforce_plus_plus_baseline"``).
        baseline_rewards: ``[batch]`` greedy-response rewards (``"remax"``).
        gamma: discount in [0, 1] (GAE, REINFORCE++, ReMax).
        lam: GAE lambda in [0, 1].
        norm_by_std: GRPO: divide by the group std; GAE/REINFORCE++/REINFORCE++-baseline:
            whiten advantages over the batch's valid tokens. Ignored by the others.
        epsilon: added to the group std (GRPO) and to the batch variance (whitening).

    Returns:
        ``(advantages, returns)``, both ``[batch, response_len]`` in the rewards' dtype
        (at least float32), without autograd history, 0 at masked positions.

    Raises:
        ValueError: unknown estimator (lists the valid ones), missing required input
            (names estimator and argument), mismatched shapes, gamma/lam outside [0, 1].
        TypeError: non-tensor inputs, unhashable group ids.
    """
    spec = ADVANTAGE_ESTIMATORS[check_choice("advantage estimator", estimator, ADVANTAGE_ESTIMATORS)]
    _check_required(spec, {"values": values, "group_ids": group_ids, "baseline_rewards": baseline_rewards})
    check_tensor("token_level_rewards", token_level_rewards, ndim=2)
    check_same_shape("token_level_rewards", token_level_rewards, response_mask=response_mask)
    if not token_level_rewards.is_floating_point():
        raise TypeError(f"token_level_rewards must be floating point, got {token_level_rewards.dtype}")
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    dtype = torch.promote_types(token_level_rewards.dtype, torch.float32)
    batch = token_level_rewards.shape[0]

    # inputs the estimator does not need are ignored (neither validated nor passed on)
    values = values if "values" in spec.requires else None
    baseline_rewards = baseline_rewards if "baseline_rewards" in spec.requires else None
    group_ids = group_ids if "group_ids" in spec.requires else None

    with torch.no_grad():
        valid = response_mask.to(token_level_rewards.device) != 0
        mask = valid.to(dtype)
        rewards = _zero_invalid(token_level_rewards.to(dtype), valid)
        if values is not None:
            check_same_shape("token_level_rewards", token_level_rewards, values=values)
            values = _zero_invalid(values.to(device=rewards.device, dtype=dtype), valid)
        if baseline_rewards is not None:
            check_tensor("baseline_rewards", baseline_rewards, ndim=1)
            if baseline_rewards.shape[0] != batch:
                raise ValueError(
                    f"baseline_rewards must have shape [{batch}], got {tuple(baseline_rewards.shape)}"
                )
            baseline_rewards = baseline_rewards.detach().to(device=rewards.device, dtype=dtype)
        index = None
        if group_ids is not None:
            index = group_index(group_ids, batch).to(rewards.device)
        inputs = AdvantageInputs(
            token_level_rewards=rewards,
            response_mask=mask,
            values=values,
            group_index=index,
            baseline_rewards=baseline_rewards,
            gamma=_check_rate("gamma", gamma),
            lam=_check_rate("lam", lam),
            norm_by_std=bool(norm_by_std),
            epsilon=float(epsilon),
        )
        advantages, returns = spec.fn(inputs)
    return advantages, returns
