"""The 2025-26 policy-loss family (GMPO, SAPO, GPG, Clip-Cov, KL-Cov, DRO, DPPO-TV/KL) and
the registry of every policy loss under verl's names.

Shared conventions with :mod:`megaflow.algorithms.policy_loss`: ``[batch, response_len]``
tensors, ``r_t = exp(log_probs - old_log_probs)`` with the log-ratio clamped to [-20, 20],
``(loss, metrics)`` with the metrics ``clip_fraction`` (the loss-specific fraction of valid
tokens whose gradient is cut or changed, see each function), ``dual_clip_fraction`` and
``approx_kl`` (token mean of ``old_log_probs - log_probs``), and rollout correction applied
as verl applies it: the detached per-token ``is_weights`` multiply the per-token loss
(GMPO: their per-sequence geometric mean multiplies the sequence loss); rejected tokens
arrive removed from ``response_mask``.

``sg[x]`` below is a stop-gradient (``x.detach()``).
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from megaflow.algorithms._checks import check_choice, check_same_shape, check_tensor
from megaflow.algorithms.aggregation import Count, aggregate_loss
from megaflow.algorithms.masked import masked_mean
from megaflow.algorithms.policy_loss import (
    _LOG_RATIO_LIMIT,
    _zero_masked,
    cispo_policy_loss,
    gspo_policy_loss,
    ppo_policy_loss,
)

_SEQ_MEAN = "seq-mean-token-mean"


def _prepare(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
             response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checked, zero-masked ``(log_probs, old_log_probs, advantages, clamped log-ratio)``."""
    check_tensor("log_probs", log_probs, ndim=2)
    check_same_shape("log_probs", log_probs, old_log_probs=old_log_probs, advantages=advantages,
                     response_mask=response_mask)
    log_probs, old_log_probs, advantages = _zero_masked(response_mask, log_probs, old_log_probs, advantages)
    log_ratio = torch.clamp(log_probs - old_log_probs.detach(), -_LOG_RATIO_LIMIT, _LOG_RATIO_LIMIT)
    return log_probs, old_log_probs.detach(), advantages, log_ratio


def _no_cut(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(like, dtype=torch.bool)


def _agg(loss_agg_mode: str, global_num_tokens: Count | None, global_num_seqs: Count | None,
         norm_length: int | float | None) -> dict:
    return dict(mode=loss_agg_mode, global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs,
                norm_length=norm_length)


def _require_seq_mean(name: str, loss_agg_mode: str) -> None:
    if loss_agg_mode != _SEQ_MEAN:
        raise ValueError(f"{name} is defined per sequence: loss_agg_mode must be {_SEQ_MEAN!r}, "
                         f"got {loss_agg_mode!r}")


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value!r}")


def geo_mean_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio_low: float = 0.4, clip_ratio_high: float = 0.4, loss_agg_mode: str = _SEQ_MEAN,
    global_num_tokens: Count | None = None, global_num_seqs: Count | None = None,
    norm_length: int | float | None = None, is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GMPO: PPO on the geometric mean of the token ratios of a sequence.

    Zhao et al. 2025, "Geometric-Mean Policy Optimization" (arXiv:2507.20673), eq. 4 with
    token-level clipping in log space: with ``l_t = log r_t`` and ``s = sign(A_i)``,
    ``l~_t = s * min(s * l_t, s * clip(l_t, -clip_ratio_low, clip_ratio_high))`` and the
    sequence loss ``L_i = -A_i * exp(mean_{t valid} l~_t)``, where ``A_i`` is the mean of the
    row's advantages over its valid tokens (the paper's sequence advantage). The bounds are
    *log-ratio* bounds (the paper's default range is ``(e^-0.4, e^0.4)``). Gradient:
    ``dL_i / dlog_probs_t = -A_i * exp(mean l~) / n_i`` on tokens whose ``l_t`` is inside the
    band (or on the side the min keeps), 0 on the others.

    Sequences are averaged over the global count of sequences with at least one valid
    token (``seq-mean-token-mean``; the only mode accepted, verl ignores the mode). With
    ``is_weights`` each ``L_i`` is multiplied by the geometric mean of the row's weights.

    Returns: ``(loss, metrics)``; ``clip_fraction`` = tokens with ``A != 0`` whose clipped
    log-ratio replaced the raw one (their gradient is 0).

    Raises:
        ValueError: shape mismatch, non-positive bounds, another ``loss_agg_mode``.
    """
    _require_seq_mean("geo_mean (GMPO)", loss_agg_mode)
    _check_positive(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high)
    log_probs, _, advantages, log_ratio = _prepare(log_probs, old_log_probs, advantages, response_mask)
    valid = response_mask != 0
    sign = torch.sign(advantages)
    clamped = torch.clamp(log_ratio, -clip_ratio_low, clip_ratio_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clamped)
    seq_ratio = masked_mean(kept, response_mask, dim=-1).exp()
    seq_adv = masked_mean(advantages, response_mask, dim=-1)
    seq_loss = -seq_adv * seq_ratio
    if is_weights is not None:
        check_same_shape("log_probs", log_probs, is_weights=is_weights)
        log_w = is_weights.detach().to(log_ratio.dtype).clamp_min(1e-10).log()
        log_w = torch.where(valid, log_w, torch.zeros_like(log_w))
        seq_loss = seq_loss * masked_mean(log_w, response_mask, dim=-1).exp().to(seq_loss.dtype)
    loss_mat = seq_loss.unsqueeze(-1).expand_as(log_ratio)
    loss = aggregate_loss(loss_mat, response_mask, **_agg(_SEQ_MEAN, global_num_tokens, global_num_seqs, None))
    cut = (sign * clamped < sign * log_ratio) & (sign != 0)
    return loss, _finish_metrics(log_ratio, cut, response_mask)


def _finish_metrics(log_ratio: torch.Tensor, cut: torch.Tensor, response_mask: torch.Tensor) -> dict:
    with torch.no_grad():
        dtype = log_ratio.dtype
        return {"clip_fraction": masked_mean(cut.to(dtype), response_mask),
                "dual_clip_fraction": masked_mean(torch.zeros_like(log_ratio), response_mask),
                "approx_kl": masked_mean(-log_ratio.detach(), response_mask)}


def sapo_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, tau_pos: float = 1.0, tau_neg: float = 1.05, loss_agg_mode: str = _SEQ_MEAN,
    global_num_tokens: Count | None = None, global_num_seqs: Count | None = None,
    norm_length: int | float | None = None, is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAPO: a smooth sigmoid gate on the ratio instead of a hard clip.

    Gao et al. 2025, "Soft Adaptive Policy Optimization" (arXiv:2511.20347), eq. 5-6: the
    per-token loss is ``-A_t * f(r_t)`` with ``f(r) = (4 / tau) * sigmoid(tau * (r - 1))``,
    ``tau = tau_pos`` where ``A_t > 0`` and ``tau_neg`` elsewhere. ``f(1) = 2 / tau``, and
    ``df/dr = 4 sigma (1 - sigma)`` is 1 at ``r = 1`` (on-policy it is the policy gradient)
    and decays smoothly away from it. Gradient: ``dL_t / dlog_probs_t = -A_t * 4 sigma (1 -
    sigma) * r_t`` with ``sigma = sigmoid(tau (r_t - 1))``. Aggregated ``seq-mean-token-mean``
    (the only mode accepted; verl forces it).

    Returns: ``(loss, metrics)``; ``clip_fraction`` is 0 (nothing is cut).

    Raises:
        ValueError: shape mismatch, ``tau_pos``/``tau_neg`` <= 0, another ``loss_agg_mode``.
    """
    _require_seq_mean("sapo", loss_agg_mode)
    _check_positive(tau_pos=tau_pos, tau_neg=tau_neg)
    log_probs, _, advantages, log_ratio = _prepare(log_probs, old_log_probs, advantages, response_mask)
    tau = torch.where(advantages > 0, torch.full_like(advantages, tau_pos), torch.full_like(advantages, tau_neg))
    gate = torch.sigmoid(tau * (log_ratio.exp() - 1.0)) * (4.0 / tau)
    loss_mat = _weighted(-advantages * gate, is_weights)
    loss = aggregate_loss(loss_mat, response_mask, **_agg(_SEQ_MEAN, global_num_tokens, global_num_seqs, None))
    return loss, _finish_metrics(log_ratio, _no_cut(log_ratio), response_mask)


def _weighted(loss_mat: torch.Tensor, is_weights: torch.Tensor | None) -> torch.Tensor:
    if is_weights is None:
        return loss_mat
    check_same_shape("loss", loss_mat, is_weights=is_weights)
    return loss_mat * is_weights.detach().to(loss_mat.dtype)


def gpg_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, loss_agg_mode: str = "token-mean", global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None, norm_length: int | float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GPG: the plain policy gradient ``-A_t * log_probs_t`` (no ratio, no clip).

    Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning" (arXiv:2504.02546), eq. 6. Gradient ``-A_t`` per valid token (times the
    aggregation's weight). ``old_log_probs`` only feeds ``approx_kl``.

    Returns: ``(loss, metrics)``; ``clip_fraction`` is 0.
    """
    log_probs, _, advantages, log_ratio = _prepare(log_probs, old_log_probs, advantages, response_mask)
    loss_mat = _weighted(-advantages * log_probs, is_weights)
    loss = aggregate_loss(loss_mat, response_mask,
                          **_agg(loss_agg_mode, global_num_tokens, global_num_seqs, norm_length))
    return loss, _finish_metrics(log_ratio, _no_cut(log_ratio), response_mask)


def dro_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, dro_beta: float = 0.1, loss_agg_mode: str = "token-mean", global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None, norm_length: int | float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DRO: policy gradient with a quadratic log-ratio penalty.

    Richemond et al. 2024, "Offline Regularised Reinforcement Learning for Large Language
    Models Alignment" (Direct Reward Optimisation, arXiv:2405.19107), eq. 8 in its per-token
    form: ``L_t = -(A_t * log_probs_t - (dro_beta / 2) * (log_probs_t - sg[old_log_probs_t])^2)``.
    Gradient ``-A_t + dro_beta * (log_probs_t - old_log_probs_t)``.

    Returns: ``(loss, metrics)``; ``clip_fraction`` is 0.

    Raises:
        ValueError: shape mismatch, ``dro_beta <= 0``.
    """
    _check_positive(dro_beta=dro_beta)
    log_probs, old, advantages, log_ratio = _prepare(log_probs, old_log_probs, advantages, response_mask)
    loss_mat = _weighted(-(advantages * log_probs - 0.5 * dro_beta * (log_probs - old) ** 2), is_weights)
    loss = aggregate_loss(loss_mat, response_mask,
                          **_agg(loss_agg_mode, global_num_tokens, global_num_seqs, norm_length))
    return loss, _finish_metrics(log_ratio, _no_cut(log_ratio), response_mask)


def _centred_covariance(advantages: torch.Tensor, log_probs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``(A_t - mean A) * (log_probs_t - mean log_probs)`` over this call's valid tokens (detached)."""
    n = valid.sum().clamp_min(1)
    a, lp = advantages.detach(), log_probs.detach()
    mean_a = torch.where(valid, a, torch.zeros_like(a)).sum() / n
    mean_lp = torch.where(valid, lp, torch.zeros_like(lp)).sum() / n
    return (a - mean_a) * (lp - mean_lp)


def clip_cov_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0, clip_cov_ub: float = 5.0, loss_agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None, global_num_seqs: Count | None = None,
    norm_length: int | float | None = None, is_weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clip-Cov: PPO's clipped surrogate, with the gradient of a few high-covariance tokens cut.

    Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning Language
    Models" (arXiv:2505.22617), section 4 (Clip-Cov): per valid token the centred covariance
    ``c_t = (A_t - mean A) * (log_probs_t - mean log_probs)`` (means over this call's valid
    tokens, detached); among the tokens the PPO clip leaves active with
    ``clip_cov_lb < c_t < clip_cov_ub``, ``max(1, floor(clip_cov_ratio * n_valid))`` are drawn
    uniformly at random (``generator``) and their loss and gradient set to 0. The rest is
    PPO's ``max(-A r, -A clip(r, 1 - low, 1 + high))`` (no dual clip).

    Returns: ``(loss, metrics)``; ``clip_fraction`` = tokens whose gradient is cut (by the PPO
    clip or the covariance draw).

    Raises:
        ValueError: shape mismatch, ``clip_cov_ratio <= 0``, ``clip_cov_lb >= clip_cov_ub``.
    """
    _check_positive(clip_cov_ratio=clip_cov_ratio)
    if not clip_cov_lb < clip_cov_ub:
        raise ValueError(f"clip_cov_lb must be < clip_cov_ub, got {clip_cov_lb!r} >= {clip_cov_ub!r}")
    log_probs, _, advantages, log_ratio = _prepare(log_probs, old_log_probs, advantages, response_mask)
    valid = response_mask != 0
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    by_clip = (clipped > unclipped) & valid
    cov = _centred_covariance(advantages, log_probs, valid)
    candidates = ((cov > clip_cov_lb) & (cov < clip_cov_ub) & valid & ~by_clip).flatten().nonzero().flatten()
    n_cut = min(max(int(clip_cov_ratio * int(valid.sum())), 1), candidates.numel())
    chosen = candidates[torch.randperm(candidates.numel(), generator=generator)[:n_cut].to(candidates.device)]
    by_cov = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    by_cov[chosen] = True
    by_cov = by_cov.view_as(valid)
    loss_mat = _weighted(torch.where(by_cov, torch.zeros_like(unclipped), torch.maximum(unclipped, clipped)),
                         is_weights)
    loss = aggregate_loss(loss_mat, response_mask,
                          **_agg(loss_agg_mode, global_num_tokens, global_num_seqs, norm_length))
    return loss, _finish_metrics(log_ratio, by_clip | by_cov, response_mask)


def kl_cov_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, kl_cov_ratio: float = 2e-4, ppo_kl_coef: float = 0.1, loss_agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None, global_num_seqs: Count | None = None,
    norm_length: int | float | None = None, is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL-Cov: the unclipped surrogate, with a KL penalty on the highest-covariance tokens.

    Cui et al. 2025 (arXiv:2505.22617), section 4 (KL-Cov): the per-token loss is ``-A_t r_t``
    and, on the ``max(1, floor(kl_cov_ratio * n_valid))`` valid tokens with the largest centred
    covariance ``c_t`` (see :func:`clip_cov_policy_loss`), ``-A_t r_t + ppo_kl_coef *
    |log_probs_t - old_log_probs_t|``. Gradient: ``-A_t r_t`` plus ``ppo_kl_coef *
    sign(log r_t)`` on the penalised tokens.

    Returns: ``(loss, metrics)``; ``clip_fraction`` = the fraction of penalised tokens.

    Raises:
        ValueError: shape mismatch, ``kl_cov_ratio <= 0``, ``ppo_kl_coef < 0``.
    """
    _check_positive(kl_cov_ratio=kl_cov_ratio)
    if not ppo_kl_coef >= 0:
        raise ValueError(f"ppo_kl_coef must be >= 0, got {ppo_kl_coef!r}")
    log_probs, _, advantages, log_ratio = _prepare(log_probs, old_log_probs, advantages, response_mask)
    valid = response_mask != 0
    n_valid = int(valid.sum())
    cov = torch.where(valid, _centred_covariance(advantages, log_probs, valid), torch.full_like(log_ratio, -torch.inf))
    penalised = torch.zeros(valid.numel(), dtype=torch.bool, device=valid.device)
    if n_valid:
        penalised[torch.topk(cov.flatten(), max(1, int(kl_cov_ratio * n_valid))).indices] = True
    penalised = penalised.view_as(valid) & valid
    loss_mat = -advantages * log_ratio.exp() + penalised * (ppo_kl_coef * log_ratio.abs())
    loss = aggregate_loss(_weighted(loss_mat, is_weights), response_mask,
                          **_agg(loss_agg_mode, global_num_tokens, global_num_seqs, norm_length))
    return loss, _finish_metrics(log_ratio, penalised, response_mask)


def _dppo(log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor,
          response_mask: torch.Tensor, *, divergence: str, clip_ratio_low: float, clip_ratio_high: float,
          clip_ratio_c: float | None, aggregation: dict, is_weights: torch.Tensor | None,
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    _check_positive(clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high)
    if clip_ratio_c is not None and not clip_ratio_c > 0:
        raise ValueError(f"clip_ratio_c (the DPPO ratio truncation) must be > 0, got {clip_ratio_c!r}")
    log_probs, old, advantages, log_ratio = _prepare(log_probs, old_log_probs, advantages, response_mask)
    ratio = log_ratio.detach().exp()
    weight = ratio if clip_ratio_c is None else ratio.clamp_max(clip_ratio_c)
    with torch.no_grad():
        p, q = log_probs.exp(), old.exp()
        if divergence == "tv":
            up_ok, down_ok = p - q <= clip_ratio_high, p - q >= -clip_ratio_low
        else:  # binary KL(q || p) of the sampled token's Bernoulli (kept / not kept)
            kl = q * (old - log_probs) + (1 - q) * torch.log((1 - q + 1e-8) / (1 - p + 1e-8))
            up_ok, down_ok = (kl <= clip_ratio_high) | (p <= q), (kl <= clip_ratio_low) | (p >= q)
        trusted = torch.where(advantages > 0, up_ok, down_ok)
    loss_mat = _weighted(-advantages * weight * log_probs * trusted, is_weights)
    loss = aggregate_loss(loss_mat, response_mask, **aggregation)
    metrics = _finish_metrics(log_ratio, ~trusted, response_mask)
    with torch.no_grad():
        metrics["dual_clip_fraction"] = masked_mean(((ratio != weight) & trusted).to(log_ratio.dtype), response_mask)
    return loss, metrics


def dppo_tv_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio_low: float = 0.15, clip_ratio_high: float = 0.15, clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean", global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None, norm_length: int | float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-TV: a divergence trust region on the sampled token's probability (binary TV).

    "Divergence Proximal Policy Optimization" (arXiv:2602.04879), the Binary-TV variant:
    with ``p = pi(y_t)``, ``q = pi_old(y_t)``, a token stays in the update when the move of
    its probability is inside the band in the direction its advantage pushes
    (``A > 0``: ``p - q <= clip_ratio_high``; else ``p - q >= -clip_ratio_low``; *absolute*
    probability bounds). The loss is ``-A_t * sg[min(r_t, clip_ratio_c)] * log_probs_t *
    sg[trusted_t]`` (the truncated ratio as a detached weight; ``clip_ratio_c`` None: no
    truncation). Gradient ``-A_t * min(r_t, c)`` on trusted tokens, 0 elsewhere.

    Returns: ``(loss, metrics)``; ``clip_fraction`` = tokens outside the trust region,
    ``dual_clip_fraction`` = trusted tokens whose ratio was truncated.

    Raises:
        ValueError: shape mismatch, non-positive bounds.
    """
    return _dppo(log_probs, old_log_probs, advantages, response_mask, divergence="tv",
                 clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                 aggregation=_agg(loss_agg_mode, global_num_tokens, global_num_seqs, norm_length),
                 is_weights=is_weights)


def dppo_kl_policy_loss(
    log_probs: torch.Tensor, old_log_probs: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor,
    *, clip_ratio_low: float = 0.05, clip_ratio_high: float = 0.05, clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean", global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None, norm_length: int | float | None = None,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPPO-KL: as :func:`dppo_tv_policy_loss` with the binary KL as the divergence.

    arXiv:2602.04879, the Binary-KL variant: ``D = q log(q / p) + (1 - q) log((1 - q) / (1 - p))``
    (``1e-8`` added inside the second log). A token with ``A > 0`` is trusted when ``D <=
    clip_ratio_high`` or its probability did not rise (``p <= q``); with ``A <= 0`` when
    ``D <= clip_ratio_low`` or it did not fall (``p >= q``).
    """
    return _dppo(log_probs, old_log_probs, advantages, response_mask, divergence="kl",
                 clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
                 aggregation=_agg(loss_agg_mode, global_num_tokens, global_num_seqs, norm_length),
                 is_weights=is_weights)


PolicyLoss = Callable[..., "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
#: Every policy loss by its verl name (``actor.policy_loss``); megaflow's ``ppo`` is verl's ``vanilla``.
POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo": ppo_policy_loss, "gspo": gspo_policy_loss, "cispo": cispo_policy_loss,
    "geo_mean": geo_mean_policy_loss, "sapo": sapo_policy_loss, "gpg": gpg_policy_loss,
    "clip_cov": clip_cov_policy_loss, "kl_cov": kl_cov_policy_loss, "dro": dro_policy_loss,
    "dppo_tv": dppo_tv_policy_loss, "dppo_kl": dppo_kl_policy_loss,
}


def compute_policy_loss(name: str, *args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dispatch to ``POLICY_LOSSES[name]``; each loss takes the shared arguments (tensors,
    aggregation, ``is_weights``) plus its own knobs as keywords.

    Raises:
        ValueError: unknown name, listing the valid ones.
        TypeError: a knob the named loss does not take.
    """
    return POLICY_LOSSES[check_choice("policy loss", name, POLICY_LOSSES)](*args, **kwargs)


__all__ = ["POLICY_LOSSES", "compute_policy_loss", "geo_mean_policy_loss", "sapo_policy_loss", "gpg_policy_loss",
           "clip_cov_policy_loss", "kl_cov_policy_loss", "dro_policy_loss", "dppo_tv_policy_loss",
           "dppo_kl_policy_loss"]
