"""Policy-gradient losses (PPO clip, dual clip, clip-higher, GSPO, CISPO) and the entropy bonus.

All losses take ``[batch, response_len]`` tensors, return ``(loss, metrics)`` where
``loss`` is a differentiable 0-d tensor aggregated by
:func:`megaflow.algorithms.aggregation.aggregate_loss` (pass global denominators for
split invariance) and ``metrics`` are detached 0-d tensors computed under ``no_grad``
as token means over this call's valid tokens (0 when there is none).

The registry of every policy loss by name (``POLICY_LOSSES`` / ``compute_policy_loss``) is in
:mod:`megaflow.algorithms.policy_loss_family`, with the GMPO/SAPO/GPG/Clip-Cov/KL-Cov/DRO/DPPO losses.
"""
from __future__ import annotations

import torch

from megaflow.algorithms._checks import check_same_shape, check_tensor
from megaflow.algorithms.aggregation import Count, aggregate_loss
from megaflow.algorithms.masked import masked_mean

_LOG_RATIO_LIMIT = 20.0


def _check_inputs(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
) -> None:
    check_tensor("log_probs", log_probs, ndim=2)
    check_same_shape(
        "log_probs", log_probs,
        old_log_probs=old_log_probs, advantages=advantages, response_mask=response_mask,
    )
    if not 0.0 <= clip_ratio_low < 1.0:
        raise ValueError(f"clip_ratio_low must be in [0, 1), got {clip_ratio_low!r}")
    if not clip_ratio_high >= 0.0:
        raise ValueError(f"clip_ratio_high must be >= 0, got {clip_ratio_high!r}")
    if clip_ratio_c is not None and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1, got {clip_ratio_c!r}")


def _zero_masked(mask: torch.Tensor, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Replace masked entries by 0 so that NaN/inf padding cannot leak into values or gradients."""
    valid = mask.to(tensors[0].device) != 0
    return tuple(torch.where(valid, t, torch.zeros_like(t)) for t in tensors)


def clipped_surrogate(
    ratio: torch.Tensor,
    advantages: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss (negated objective), ``[batch, response_len]``.

    PPO, Schulman et al. 2017, eq. 7, with asymmetric range (DAPO "Clip-Higher", Yu et al.
    2025): ``L = max(-A r, -A clip(r, 1 - low, 1 + high))``. Dual clip (Ye et al. 2020,
    "Mastering Complex Control in MOBA Games with Deep RL", dual-clip PPO): where
    ``A < 0``, ``L = min(L, -A c)`` bounds the loss of a token whose ratio exploded.

    Returns:
        ``(loss, clipped, dual_clipped)``: the loss and bool masks of where the ordinary
        clip (``-A clip(r) > -A r``) and the dual clip (``A < 0`` and ``-A c < L``) are active.
    """
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if clip_ratio_c is None:
        return loss, clipped, torch.zeros_like(clipped)
    loss_dual = -advantages * clip_ratio_c
    dual_clipped = (advantages < 0) & (loss_dual < loss)
    return torch.where(dual_clipped, loss_dual, loss), clipped, dual_clipped


def _finish(
    loss_mat: torch.Tensor,
    log_ratio: torch.Tensor,
    clipped: torch.Tensor,
    dual_clipped: torch.Tensor,
    response_mask: torch.Tensor,
    aggregation: dict,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    if is_weights is not None:  # rollout correction: detached per-token weights (TIS)
        check_same_shape("loss", loss_mat, is_weights=is_weights)
        loss_mat = loss_mat * is_weights.detach().to(loss_mat.dtype)
    loss = aggregate_loss(loss_mat, response_mask, **aggregation)
    with torch.no_grad():
        metrics = {
            "clip_fraction": masked_mean(clipped.to(loss_mat.dtype), response_mask),
            "dual_clip_fraction": masked_mean(dual_clipped.to(loss_mat.dtype), response_mask),
            "approx_kl": masked_mean(-log_ratio.detach(), response_mask),
        }
    return loss, metrics


def ppo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    norm_length: int | float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with token-level ratio ``r_t = exp(log_probs - old_log_probs)``.

    See :func:`clipped_surrogate` for the formula (symmetric, clip-higher, dual clip).
    The log-ratio is clamped to [-20, 20] before ``exp``.

    Args:
        log_probs: ``[batch, response_len]`` current-policy log-probs (with gradient).
        old_log_probs: same shape, behaviour-policy log-probs (no gradient needed).
        advantages: same shape.
        response_mask: same shape, non-zero = valid.
        clip_ratio_low / clip_ratio_high: ``eps_low`` in [0, 1), ``eps_high`` >= 0.
        clip_ratio_c: dual-clip constant ``c > 1`` (e.g. 3.0), None = off.
        loss_agg_mode, global_num_tokens, global_num_seqs, norm_length: see
            :func:`megaflow.algorithms.aggregation.aggregate_loss`.
        is_weights: optional detached per-token weights multiplied into the per-token loss
            before aggregation (rollout correction,
            :func:`megaflow.algorithms.rollout_correction.importance_weights`).

    Returns:
        ``(loss, metrics)`` with ``clip_fraction`` (tokens where the clip is active),
        ``dual_clip_fraction`` (tokens where the dual clip is active), ``approx_kl``
        (token mean of ``old_log_probs - log_probs``, the k1 estimate of
        ``KL(pi_old || pi_theta)``).

    Raises:
        ValueError: shape mismatch, unknown ``loss_agg_mode``, clip ranges out of bounds.
    """
    _check_inputs(
        log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    log_probs, old_log_probs, advantages = _zero_masked(response_mask, log_probs, old_log_probs, advantages)
    log_ratio = torch.clamp(log_probs - old_log_probs, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    loss_mat, clipped, dual = clipped_surrogate(
        log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    aggregation = dict(mode=loss_agg_mode, global_num_tokens=global_num_tokens,
                       global_num_seqs=global_num_seqs, norm_length=norm_length)
    return _finish(loss_mat, log_ratio, clipped, dual, response_mask, aggregation, is_weights)


def gspo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    norm_length: int | float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO-token loss: sequence-level ratio, token-level gradient.

    Zheng et al. 2025, "Group Sequence Policy Optimization" (arXiv:2507.18071). The
    sequence ratio ``s_i = exp(mean_{t valid} (log_probs - old_log_probs))`` (length
    normalised) is used for every token of sequence ``i`` through
    ``s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)]``: its value is ``s_i``, its gradient
    ``s_i * grad log pi(y_t)``, so per-token advantages are possible and, with one
    advantage per sequence and ``"seq-mean-token-mean"``, the gradient equals
    sequence-level GSPO. ``s_{i,t}`` is then clipped like PPO (:func:`clipped_surrogate`;
    the paper's ranges are 3e-4 / 4e-4; dual clip optional). The log of ``s_{i,t}`` is
    clamped to [-20, 20].

    Args and returns: as :func:`ppo_policy_loss`; ``approx_kl`` is the token-level k1.
    """
    _check_inputs(
        log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    log_probs, old_log_probs, advantages = _zero_masked(response_mask, log_probs, old_log_probs, advantages)
    log_ratio = log_probs - old_log_probs
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + log_probs - log_probs.detach()
    token_log_ratio = torch.clamp(token_log_ratio, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    loss_mat, clipped, dual = clipped_surrogate(
        token_log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c
    )
    aggregation = dict(mode=loss_agg_mode, global_num_tokens=global_num_tokens,
                       global_num_seqs=global_num_seqs, norm_length=norm_length)
    return _finish(loss_mat, log_ratio, clipped, dual, response_mask, aggregation, is_weights)


def cispo_policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    norm_length: int | float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO: clipped importance-sampling weight times advantage times log-prob.

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning
    Attention" (arXiv:2506.13585), the CISPO objective: the per-token loss is
    ``-sg[clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A_t * log pi(y_t)`` with
    ``r_t = exp(log_probs - old_log_probs)`` (the paper's eq. with both bounds
    ``eps_IS_low`` / ``eps_IS_high``; MiniMax-M1 sets the lower one so wide that it never
    binds, which ``clip_ratio_low`` close to 1 reproduces). Unlike PPO's clip, no token's
    gradient is dropped: every token keeps ``A_t grad log pi(y_t)`` scaled by the
    clipped weight. Aggregated with the same modes and global denominators as the other
    losses.

    Not combinable with a dual clip (``clip_ratio_c`` must be None: the weight is already
    bounded) nor with sequence-level ratios (CISPO's weight is per token).

    Args and returns: as :func:`ppo_policy_loss`; ``clip_fraction`` is the fraction of
    tokens whose weight was clipped (either bound), ``dual_clip_fraction`` is always 0.

    Raises:
        ValueError: as :func:`ppo_policy_loss`, and ``clip_ratio_c`` not None.
    """
    if clip_ratio_c is not None:
        raise ValueError("CISPO takes no dual clip (clip_ratio_c must be None): its weight is already bounded")
    _check_inputs(log_probs, old_log_probs, advantages, response_mask, clip_ratio_low, clip_ratio_high, None)
    log_probs, old_log_probs, advantages = _zero_masked(response_mask, log_probs, old_log_probs, advantages)
    log_ratio = torch.clamp(log_probs - old_log_probs, -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    loss_mat = -weight * advantages * log_probs
    aggregation = dict(mode=loss_agg_mode, global_num_tokens=global_num_tokens,
                       global_num_seqs=global_num_seqs, norm_length=norm_length)
    return _finish(loss_mat, log_ratio, weight != ratio, torch.zeros_like(ratio, dtype=torch.bool), response_mask,
                   aggregation, is_weights)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution, ``[..., vocab] -> [...]`` (nats).

    ``H = logsumexp(z) - sum_v softmax(z)_v z_v``; exact and stable for large logits.
    (For tensor-parallel vocab shards use the vocab-parallel version in
    ``megaflow.megatron.logprobs``.)
    """
    check_tensor("logits", logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def entropy_bonus(
    entropy: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    norm_length: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Aggregated policy entropy; the total loss is ``pg_loss - entropy_coeff * bonus``.

    Entropy regularisation as in PPO, Schulman et al. 2017, eq. 9 (``+ c2 S[pi](s_t)``).

    Args:
        entropy: ``[batch, response_len]`` per-token entropy (with gradient).
        response_mask: same shape.
        loss_agg_mode, global_num_tokens, global_num_seqs, norm_length: see
            :func:`megaflow.algorithms.aggregation.aggregate_loss`.

    Returns:
        ``(bonus, {"entropy": token-mean entropy of this call})``.
    """
    check_tensor("entropy", entropy, ndim=2)
    bonus = aggregate_loss(
        entropy, response_mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length,
    )
    with torch.no_grad():
        metrics = {"entropy": masked_mean(entropy.detach(), response_mask)}
    return bonus, metrics
