"""verl 0.9.1's rollout-correction surface as pure functions: k1/k2/k3 rejection statistics,
chained rejection options, batch-normalised importance weights, the IcePop weight band,
verl's off-policy metrics, and the bypass-mode policy loss (IS / rejection recomputed inside
the loss; REINFORCE or PPO-clip).

Notation (verl's): ``log_ratio = log pi_train - log pi_rollout`` per valid token, where
``pi_train`` is the trainer's policy the correction is taken for (``pi_old`` in decoupled
mode, the current policy inside the bypass loss). The estimators of ``KL(pi_rollout ||
pi_train)`` from the rollout's own samples (Schulman 2020, "Approximating KL Divergence")
are, per token:

* ``k1 = -log_ratio = log(pi_rollout / pi_train)`` (note: the reverse orientation of the IS
  weight ``exp(log_ratio)``);
* ``k2 = log_ratio^2 / 2``;
* ``k3 = exp(log_ratio) - 1 - log_ratio`` (>= 0).

A rejection option ``<level>_<k>`` with level ``token``, ``seq_sum``, ``seq_mean`` or
``seq_max`` (``seq_max`` for k2/k3 only) computes that statistic per token, or its sum / mean
/ max over each row's valid tokens, and keeps a token or row when the statistic is inside the
option's band: ``[log lower, log upper]`` for k1 (the bounds are ratios; a single value ``u``
means ``[1/u, u]``), ``<= upper`` for k2/k3. Several options are AND-ed. A row without valid
tokens has statistic 0 and is never rejected.

Log-ratios are clamped to [-20, 20] before ``exp`` and for the statistics (verl's safety
bound). All tensors are ``[batch, response_len]`` with a mask of the same shape (non-zero =
valid); nothing here needs gradients except the loss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from megaflow.algorithms._checks import check_choice
from megaflow.algorithms.aggregation import Count, aggregate_loss
from megaflow.algorithms.masked import masked_mean
from megaflow.algorithms.policy_loss import ppo_policy_loss
from megaflow.algorithms.rollout_correction import _delta

SAFETY_BOUND = 20.0
ESTIMATORS = ("k1", "k2", "k3")
REJECTION_LEVELS = ("token", "seq_sum", "seq_mean", "seq_max")
#: every rejection option verl 0.9.1 accepts (``rollout_rs``)
REJECTION_OPTIONS = tuple(f"{level}_{k}" for level in REJECTION_LEVELS for k in ESTIMATORS
                          if not (level == "seq_max" and k == "k1"))
BYPASS_LOSS_TYPES = ("ppo_clip", "reinforce")


@dataclass(frozen=True)
class RejectionBand:
    """The accepted band of one option: ``lower``/``upper`` are ratios for k1 (``lower`` > 0),
    ``upper`` an upper bound of the statistic for k2/k3 (``lower`` None)."""

    option: str
    upper: float
    lower: float | None = None


def parse_rejection(options: str, thresholds: str | float) -> list[RejectionBand]:
    """verl's ``rollout_rs`` / ``rollout_rs_threshold`` pair as a list of bands.

    Args:
        options: comma-separated options (e.g. ``"token_k1,seq_max_k3"``); duplicates dropped.
        thresholds: one value shared by every option or one per option (comma-separated). A k1
            entry is ``"lower_upper"`` (ratios) or a single ``u`` meaning ``[1/u, u]``; a k2/k3
            entry is a single upper bound.

    Raises:
        ValueError: unknown option (lists the valid ones), no option, a count of thresholds that
            is neither 1 nor the number of options, a non-positive or malformed bound, a
            ``lower_upper`` pair for k2/k3, ``lower > upper``.
    """
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    if not names:
        raise ValueError("rejection options: need at least one option")
    for name in names:
        check_choice("rejection option", name, REJECTION_OPTIONS)
    specs = [s.strip() for s in str(thresholds).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rejection thresholds: give one value for all options or one per option "
                         f"({len(names)}), got {len(specs)}: {thresholds!r}")
    specs = specs * len(names) if len(specs) == 1 else specs
    return [_band(name, spec) for name, spec in zip(names, specs, strict=True)]


def _band(option: str, spec: str) -> RejectionBand:
    try:
        values = [float(v) for v in spec.split("_")]
    except ValueError:
        raise ValueError(f"rejection threshold {spec!r} of {option!r} is not a number") from None
    if any(not v > 0 for v in values) or len(values) > 2:
        raise ValueError(f"rejection threshold {spec!r} of {option!r}: need positive bounds "
                         f"(k1: 'lower_upper' or one u; k2/k3: one upper bound)")
    if not option.endswith("k1"):
        if len(values) != 1:
            raise ValueError(f"rejection threshold {spec!r} of {option!r}: k2/k3 take one upper bound")
        return RejectionBand(option, values[0])
    lower, upper = values if len(values) == 2 else (1.0 / values[0], values[0])
    if not lower <= upper:
        raise ValueError(f"rejection threshold {spec!r} of {option!r}: lower {lower} > upper {upper}")
    return RejectionBand(option, upper, lower)


def _log_ratio(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
               response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(clamped ``log pi_train - log pi_rollout`` with 0 on masked tokens, bool valid mask)."""
    delta, valid = _delta(train_log_probs, rollout_log_probs, response_mask)
    return delta.clamp(-SAFETY_BOUND, SAFETY_BOUND), valid


def token_divergence(log_ratio: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token k1 / k2 / k3 of ``KL(pi_rollout || pi_train)`` (module docstring), same shape."""
    check_choice("KL estimator", estimator, ESTIMATORS)
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio ** 2
    return torch.expm1(log_ratio) - log_ratio


def rejection_statistic(log_ratio: torch.Tensor, valid: torch.Tensor, option: str) -> torch.Tensor:
    """The statistic of ``option`` broadcast over each row, ``[batch, response_len]``.

    ``token_*``: the per-token divergence; ``seq_sum_*`` / ``seq_mean_*`` / ``seq_max_*``: its
    sum / mean / max over the row's valid tokens (0 for an empty row).
    """
    check_choice("rejection option", option, REJECTION_OPTIONS)
    level, estimator = option.rsplit("_", 1)
    per_token = torch.where(valid, token_divergence(log_ratio, estimator), torch.zeros_like(log_ratio))
    if level == "token":
        return per_token
    if level == "seq_sum":
        per_row = per_token.sum(-1)
    elif level == "seq_mean":
        per_row = per_token.sum(-1) / valid.sum(-1).clamp_min(1)
    else:
        masked = torch.where(valid, per_token, torch.full_like(per_token, -torch.inf)).amax(-1)
        per_row = torch.where(valid.any(-1), masked, torch.zeros_like(masked))
    return per_row[:, None].expand_as(per_token)


def chained_rejection_mask(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                           response_mask: torch.Tensor, bands: list[RejectionBand],
                           ) -> tuple[torch.Tensor, dict[str, float]]:
    """The response mask with every token (or row) that fails any band removed (options AND-ed).

    verl's rejection sampling (``compute_rollout_rejection_mask``); the k1 bounds are compared
    in log space. Metrics (verl's names, prefix-free): per option
    ``rollout_rs_<option>_masked_fraction`` (valid tokens it rejects) and
    ``rollout_rs_<option>_seq_masked_fraction`` (rows with a valid token it rejects, over rows
    with valid tokens); overall ``rollout_rs_masked_fraction`` and
    ``rollout_rs_seq_masked_fraction`` (rows with any rejected token over *all* rows, empty
    rows included, as verl counts them).

    Returns:
        ``(kept_mask, metrics)``: ``kept_mask`` has ``response_mask``'s dtype.
    """
    log_ratio, valid = _log_ratio(train_log_probs, rollout_log_probs, response_mask)
    keep = torch.ones_like(valid)
    metrics: dict[str, float] = {}
    n_tok, n_seq = max(int(valid.sum()), 1), max(int(valid.any(-1).sum()), 1)
    for band in bands:
        stat = rejection_statistic(log_ratio, valid, band.option)
        ok = stat <= (math.log(band.upper) if band.lower is not None else band.upper)
        if band.lower is not None:
            ok &= stat >= math.log(band.lower)
        dropped = valid & ~ok
        metrics[f"rollout_rs_{band.option}_masked_fraction"] = float(dropped.sum()) / n_tok
        metrics[f"rollout_rs_{band.option}_seq_masked_fraction"] = float(dropped.any(-1).sum()) / n_seq
        keep &= ok
    dropped = valid & ~keep
    metrics["rollout_rs_masked_fraction"] = float(dropped.sum()) / n_tok
    metrics["rollout_rs_seq_masked_fraction"] = float(dropped.any(-1).float().mean()) if len(valid) else 0.0
    return torch.where(keep, response_mask, torch.zeros_like(response_mask)), metrics


def truncated_is_weights(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                         response_mask: torch.Tensor, *, level: str, threshold: float,
                         batch_normalize: bool = False) -> tuple[torch.Tensor, float]:
    """verl's TIS weights ``min(w, threshold)`` with optional batch normalisation.

    ``w = exp(log_ratio)`` per token (``level="token"``) or ``exp(sum_t log_ratio)`` per row
    (``"sequence"``), over every valid token of ``response_mask`` (Yao et al. 2025, "Your
    Efficient RL Framework Secretly Brings You Off-Policy RL Training"). With
    ``batch_normalize`` the truncated weights are divided by their mean: over valid tokens
    for token weights, over the per-row weights of rows with valid tokens for sequence
    weights (a mean <= 1e-8 leaves them unchanged).

    Returns:
        ``(weights, factor)``: detached float32 weights, 0 on masked tokens, and the divisor
        (1.0 without normalisation).

    Raises:
        ValueError: unknown level, ``threshold <= 0``.
    """
    check_choice("importance-weight level", level, ("token", "sequence"))
    if not threshold > 0:
        raise ValueError(f"importance-weight threshold must be > 0, got {threshold!r}")
    delta, valid = _delta(train_log_probs, rollout_log_probs, response_mask)
    per = delta if level == "token" else delta.sum(-1, keepdim=True).expand_as(delta)
    log_ratio = per.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    w = torch.where(valid, log_ratio.exp().clamp_max(threshold), torch.zeros_like(log_ratio))
    if not batch_normalize:
        return w, 1.0
    return batch_normalize_weights(w, response_mask, per_sequence=level == "sequence")


def batch_normalize_weights(weights: torch.Tensor, response_mask: torch.Tensor, *,
                            per_sequence: bool) -> tuple[torch.Tensor, float]:
    """Divide non-negative weights ``[batch, response_len]`` by their batch mean (verl's
    ``rollout_is_batch_normalize``): the mean over valid tokens, or with ``per_sequence``
    (one weight per row) over the rows with valid tokens. A mean <= 1e-8 leaves them as they
    are. Returns ``(weights, divisor)`` (divisor 1.0 when unchanged)."""
    valid = response_mask != 0
    w = torch.where(valid, weights, torch.zeros_like(weights))
    if per_sequence:
        rows = valid.any(-1)
        mean = (w.amax(-1) * rows).sum() / rows.sum().clamp_min(1)
    else:
        mean = w.sum() / valid.sum().clamp_min(1)
    factor = float(mean)
    return (w / mean, factor) if factor > 1e-8 else (w, 1.0)


def icepop_weight_band(weights: torch.Tensor, *, lower: float, upper: float) -> torch.Tensor:
    """IcePop as a *weight* band: weights outside ``[lower, upper]`` become 0, the others stay.

    inclusionAI 2025, Ring-1T report, IcePop's masked importance weight
    ``M(w) = w * 1[lower <= w <= upper]``. Unlike rejection the response mask is untouched, so
    zeroed tokens still count in the loss's token/sequence denominators.

    Raises:
        ValueError: ``lower <= 0`` or ``lower > upper``.
    """
    if not 0 < lower <= upper:
        raise ValueError(f"IcePop band needs 0 < lower <= upper, got [{lower!r}, {upper!r}]")
    inside = (weights >= lower) & (weights <= upper)
    return torch.where(inside, weights, torch.zeros_like(weights))


def offpolicy_metrics(train_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                      response_mask: torch.Tensor) -> dict[str, float]:
    """verl's off-policy diagnostics under verl's names (``compute_offpolicy_metrics``).

    With ``m_b = mean_t log pi(y_t)`` over row ``b``'s valid tokens (0 for an empty row; the
    means over rows below include empty rows, as verl's do):

    * ``training_ppl`` / ``rollout_ppl``: mean over rows of ``exp(-m_b)``;
      ``training_log_ppl`` / ``rollout_log_ppl``: mean over rows of ``-m_b``;
    * ``log_ppl_diff`` = mean of ``d_b = m_b(rollout) - m_b(train)``, ``log_ppl_abs_diff`` the
      mean of ``|d_b|``, ``log_ppl_diff_max`` / ``_min``, ``ppl_ratio`` the mean of ``exp(d_b)``;
    * ``kl`` / ``k3_kl``: token means of k1 / k3 (``KL(pi_rollout || pi_train)``);
    * ``chi2_token`` = token mean of ``rho^2`` minus 1, ``rho = exp(log_ratio)``;
      ``chi2_seq`` = mean over rows of ``exp(2 sum_t log_ratio)`` minus 1 (Pearson chi^2
      divergence estimates).

    Raises:
        ValueError: shape mismatch, no valid token.
    """
    raw, valid = _delta(train_log_probs, rollout_log_probs, response_mask)
    if not valid.any():
        raise ValueError("off-policy metrics need at least one valid token")
    log_ratio = raw.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    train = train_log_probs.detach().float()
    m_train = masked_mean(torch.where(valid, train, torch.zeros_like(train)), valid, dim=-1)
    m_rollout = m_train - masked_mean(raw, valid, dim=-1)  # mean log pi_rollout = mean log pi_train - mean delta
    diff = m_rollout - m_train
    return {
        "training_ppl": float((-m_train).exp().mean()), "training_log_ppl": float((-m_train).mean()),
        "rollout_ppl": float((-m_rollout).exp().mean()), "rollout_log_ppl": float((-m_rollout).mean()),
        "kl": float(masked_mean(-raw, valid)), "k3_kl": float(masked_mean(raw.exp() - raw - 1, valid)),
        "log_ppl_diff": float(diff.mean()), "log_ppl_abs_diff": float(diff.abs().mean()),
        "log_ppl_diff_max": float(diff.max()), "log_ppl_diff_min": float(diff.min()),
        "ppl_ratio": float(diff.exp().mean()),
        "chi2_token": float(masked_mean((2 * log_ratio).exp(), valid)) - 1.0,
        "chi2_seq": float((2 * raw.sum(-1)).clamp(-2 * SAFETY_BOUND, 2 * SAFETY_BOUND).exp().mean()) - 1.0,
    }


def bypass_policy_loss(
    log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, advantages: torch.Tensor,
    response_mask: torch.Tensor, *, loss_type: str = "ppo_clip", is_level: str | None = None,
    is_threshold: float = 2.0, is_batch_normalize: bool = False, rejection: list[RejectionBand] | None = None,
    weights_over_kept: bool = False,
    clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean", global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None, norm_length: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The bypass-mode policy loss (``pi_old = pi_rollout``), verl's ``bypass_mode`` loss.

    Inside the loss, under no_grad, every micro-batch: the IS weights (current vs rollout
    log-prob, :func:`truncated_is_weights`) and the rejection mask
    (:func:`chained_rejection_mask`); the weights are taken over every valid token (verl) or,
    with ``weights_over_kept``, over the kept ones. Then

    * ``"reinforce"``: ``L_t = -A_t * log_probs_t * sg[w_t]`` (w = 1 without IS) on the kept
      tokens (Williams 1992, REINFORCE, with truncated IS);
    * ``"ppo_clip"``: PPO's clipped surrogate with ratio ``pi / pi_rollout`` on the kept
      tokens; no IS weight (the ratio already is one; verl computes weights only for metrics).

    Denominators: ``global_num_tokens`` / ``global_num_seqs`` are the engine's counts of the
    mini-batch fixed *before* rejection (the rejection happens here, per micro-batch), so
    rejected tokens stay in the denominator: a rejected token lowers the loss's scale instead
    of renormalising over the survivors. Without them this call's counts of
    ``response_mask`` (not of the kept mask) are used, the same convention.

    Returns:
        ``(loss, metrics)`` with ``clip_fraction``, ``dual_clip_fraction``, ``approx_kl`` (over
        the kept tokens) and, as 0-d tensors, ``rollout_rs_masked_fraction`` and
        ``rollout_is_mean`` (token mean of the weights before normalisation; 1 without IS).

    Raises:
        ValueError: unknown ``loss_type``/``is_level``, and as the functions it calls.
    """
    check_choice("bypass loss type", loss_type, BYPASS_LOSS_TYPES)
    valid = response_mask != 0
    with torch.no_grad():
        kept, rs = (chained_rejection_mask(log_probs, rollout_log_probs, response_mask, rejection) if rejection
                    else (response_mask, {"rollout_rs_masked_fraction": 0.0}))
        weights = None
        if is_level is not None:
            over = kept if weights_over_kept else response_mask
            weights, _ = truncated_is_weights(log_probs, rollout_log_probs, over, level=is_level,
                                              threshold=is_threshold, batch_normalize=is_batch_normalize)
    n_tok = valid.sum() if global_num_tokens is None else global_num_tokens
    n_seq = valid.any(-1).sum() if global_num_seqs is None else global_num_seqs
    if loss_type == "ppo_clip":
        loss, metrics = ppo_policy_loss(log_probs, rollout_log_probs, advantages, kept,
                                        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high,
                                        clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode,
                                        global_num_tokens=n_tok, global_num_seqs=n_seq, norm_length=norm_length)
    else:
        kept_valid = kept != 0
        lp = torch.where(kept_valid, log_probs, torch.zeros_like(log_probs))
        adv = torch.where(kept_valid, advantages, torch.zeros_like(advantages))
        loss_mat = -adv * lp * (1.0 if weights is None else weights.to(lp.dtype))
        loss = aggregate_loss(loss_mat, kept, loss_agg_mode, global_num_tokens=n_tok, global_num_seqs=n_seq,
                              norm_length=norm_length)
        with torch.no_grad():
            zero = masked_mean(torch.zeros_like(lp), kept)
            metrics = {"clip_fraction": zero, "dual_clip_fraction": zero,
                       "approx_kl": masked_mean((rollout_log_probs - lp).detach(), kept)}
    metrics["rollout_rs_masked_fraction"] = torch.tensor(rs["rollout_rs_masked_fraction"])
    with torch.no_grad():
        metrics["rollout_is_mean"] = (masked_mean(weights, response_mask) if weights is not None
                                      else torch.tensor(1.0))
    return loss, metrics


__all__ = ["ESTIMATORS", "REJECTION_OPTIONS", "BYPASS_LOSS_TYPES", "RejectionBand", "parse_rejection",
           "token_divergence", "rejection_statistic", "chained_rejection_mask", "truncated_is_weights",
           "batch_normalize_weights",
           "icepop_weight_band", "offpolicy_metrics", "bypass_policy_loss"]
