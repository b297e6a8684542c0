"""Rollout correction: importance weights and rejection masks for the gap between the
rollout engine's log-probs and the trainer's.

The rollout engine (vLLM) samples with its own kernels, precision and sometimes stale
weights, so the sampling policy ``pi_rollout`` differs from the trainer's ``pi_old``
(the policy the PPO ratio is taken against). With ``delta_t = log pi_old(y_t) -
log pi_rollout(y_t)`` on the valid response tokens:

* **truncated importance sampling** (TIS; Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training"): the policy loss of each token is
  multiplied by the detached weight ``min(w, C)``, where ``w`` is

  - ``"token"``: ``exp(delta_t)``;
  - ``"sequence"``: ``exp(sum_t delta_t)``, the same for every token of a response
    (the product of the token ratios);
  - ``"geometric"``: ``exp(mean_t delta_t)``, the per-sequence geometric mean;

* **rejection** (masking instead of weighting), tokens leave the loss *and* the global
  denominators (token and sequence counts of the aggregation) because the caller removes
  them from the ``response_mask`` the update sees:

  - ``"token"``: tokens whose ratio ``exp(delta_t)`` leaves ``[lower, upper]`` (IcePop's
    token mask, inclusionAI's Ring-1T report, 2025);
  - ``"geometric"``: whole sequences whose geometric-mean ratio ``exp(mean_t delta_t)``
    leaves ``[lower, upper]`` (seq-mask-TIS / MIS; Liu et al. 2025, "When Speed Kills
    Stability: Demystifying RL Collapse from the Training-Inference Mismatch");
  - ``"seq_sum"`` / ``"seq_mean"``: whole sequences whose ``sum_t delta_t`` /
    ``mean_t delta_t`` (log-ratio units) leaves ``[lower, upper]``.

All functions take ``[batch, response_len]`` float tensors and a mask of the same shape
(non-zero = valid), are pure and never need gradients (everything is detached). A row
without valid tokens gets weight 0 and is never counted as rejected.
"""
from __future__ import annotations

import math

import torch

from megaflow.algorithms._checks import check_choice, check_same_shape, check_tensor

IS_LEVELS = ("token", "sequence", "geometric")
REJECTION_MODES = ("token", "geometric", "seq_sum", "seq_mean")
#: modes whose bounds are ratios (> 0) rather than log-ratios
RATIO_BOUND_MODES = ("token", "geometric")
_LOG_LIMIT = 20.0


def _delta(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
           response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(``delta`` with 0 on masked tokens, bool valid mask), both ``[batch, response_len]``."""
    check_tensor("old_log_probs", old_log_probs, ndim=2)
    check_same_shape("old_log_probs", old_log_probs, rollout_log_probs=rollout_log_probs,
                     response_mask=response_mask)
    valid = response_mask != 0
    delta = torch.where(valid, old_log_probs.detach().float() - rollout_log_probs.detach().float(),
                        torch.zeros((), dtype=torch.float32, device=old_log_probs.device))
    return delta, valid


def _per_sequence(delta: torch.Tensor, valid: torch.Tensor, how: str) -> torch.Tensor:
    """``[batch]`` sum or mean of ``delta`` over each row's valid tokens (0 for empty rows)."""
    total = delta.sum(-1)
    if how == "sum":
        return total
    return total / valid.sum(-1).clamp_min(1)


def _log_statistic(delta: torch.Tensor, valid: torch.Tensor, how: str) -> torch.Tensor:
    """``[batch, response_len]``: ``delta`` itself (``"token"``) or each row's ``"sum"`` /
    ``"mean"`` of it broadcast over the row."""
    if how == "token":
        return delta
    return _per_sequence(delta, valid, how)[:, None].expand_as(delta)


def importance_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                       response_mask: torch.Tensor, *, level: str, threshold: float) -> torch.Tensor:
    """Truncated importance weights ``min(w, threshold)`` (TIS), ``[batch, response_len]``.

    Args:
        old_log_probs: the trainer's log-probs of the sampled tokens (``pi_old``).
        rollout_log_probs: the rollout engine's log-probs of the same tokens.
        response_mask: non-zero on valid response tokens.
        level: ``"token"``, ``"sequence"`` or ``"geometric"`` (module docstring).
        threshold: the truncation ``C > 0`` (weights above it become ``C``).

    Returns:
        Detached float32 weights, 0 on masked tokens. Log-ratios are clamped to [-20, 20]
        before ``exp``.

    Raises:
        ValueError: shape mismatch, unknown level, ``threshold <= 0``.
    """
    check_choice("importance-weight level", level, IS_LEVELS)
    if not threshold > 0:
        raise ValueError(f"importance-weight threshold must be > 0, got {threshold!r}")
    delta, valid = _delta(old_log_probs, rollout_log_probs, response_mask)
    log_w = _log_statistic(delta, valid, {"token": "token", "sequence": "sum", "geometric": "mean"}[level])
    w = log_w.clamp(-_LOG_LIMIT, _LOG_LIMIT).exp().clamp_max(threshold)
    return torch.where(valid, w, torch.zeros_like(w))


def rejection_mask(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                   response_mask: torch.Tensor, *, mode: str, lower: float, upper: float) -> torch.Tensor:
    """The response mask with rejected tokens (or whole sequences) removed.

    Args:
        old_log_probs, rollout_log_probs, response_mask: as :func:`importance_weights`.
        mode: ``"token"``, ``"geometric"`` (bounds are ratios, ``0 < lower <= upper``),
            ``"seq_sum"`` or ``"seq_mean"`` (bounds are log-ratios, ``lower <= upper``).
        lower, upper: the accepted band (inclusive).

    Returns:
        ``[batch, response_len]`` mask of ``response_mask``'s dtype: ``response_mask`` where
        accepted, 0 where rejected.

    Raises:
        ValueError: shape mismatch, unknown mode, a band with ``lower > upper`` or a ratio
            bound ``<= 0``.
    """
    check_choice("rejection mode", mode, REJECTION_MODES)
    if not lower <= upper:
        raise ValueError(f"rejection band needs lower <= upper, got [{lower!r}, {upper!r}]")
    if mode in RATIO_BOUND_MODES and not lower > 0:
        raise ValueError(f"rejection mode {mode!r} bounds a ratio: lower must be > 0, got {lower!r}")
    delta, valid = _delta(old_log_probs, rollout_log_probs, response_mask)
    stat = _log_statistic(delta, valid, {"token": "token", "seq_sum": "sum", "geometric": "mean",
                                         "seq_mean": "mean"}[mode])
    if mode in RATIO_BOUND_MODES:  # compare in log space: exp(stat) in [lower, upper]
        lo, hi = math.log(lower), math.log(upper)
    else:
        lo, hi = lower, upper
    keep = (stat >= lo) & (stat <= hi) & valid
    return torch.where(keep, response_mask, torch.zeros_like(response_mask))


def rollout_correction_metrics(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, *, weights: torch.Tensor | None = None,
                               kept_mask: torch.Tensor | None = None) -> dict[str, float]:
    """Mismatch and correction statistics of one batch (plain floats, prefix-free names).

    * ``mismatch_mean`` / ``mismatch_max``: masked mean and max of ``|delta_t|`` (nats);
    * ``token_mult_prob_error``: masked mean of ``exp(|delta_t|)`` (NeMo-RL's metric; 1 when
      the two policies agree);
    * ``seq_sum_kl``: mean over sequences of ``sum_t (log pi_rollout - log pi_old)``, the k1
      estimate of ``KL(pi_rollout || pi_old)`` per sequence from the rollout's own samples;
    * with ``weights``: ``weight_mean`` / ``weight_max`` over valid tokens;
    * with ``kept_mask``: ``rejected_token_fraction`` and ``fully_rejected_seq_fraction``
      (sequences with valid tokens of which none is kept, over sequences with valid tokens).

    Empty batches (no valid token) give 0 for every statistic (1 for the multiplicative error).
    """
    delta, valid = _delta(old_log_probs, rollout_log_probs, response_mask)
    n = int(valid.sum())
    has_tokens = valid.any(-1)
    n_seq = int(has_tokens.sum())
    abs_delta = delta.abs()
    out = {
        "mismatch_mean": float(abs_delta.sum() / n) if n else 0.0,
        "mismatch_max": float(abs_delta.max()) if n else 0.0,
        "token_mult_prob_error": float((abs_delta.exp() * valid).sum() / n) if n else 1.0,
        "seq_sum_kl": float((-delta.sum(-1))[has_tokens].sum() / n_seq) if n_seq else 0.0,
    }
    if weights is not None:
        out["weight_mean"] = float((weights * valid).sum() / n) if n else 0.0
        out["weight_max"] = float(torch.where(valid, weights, torch.zeros_like(weights)).max()) if n else 0.0
    if kept_mask is not None:
        kept = (kept_mask != 0) & valid
        out["rejected_token_fraction"] = float(1.0 - kept.sum() / n) if n else 0.0
        rejected_seqs = has_tokens & ~kept.any(-1)
        out["fully_rejected_seq_fraction"] = float(rejected_seqs.sum() / n_seq) if n_seq else 0.0
    return out


__all__ = ["importance_weights", "rejection_mask", "rollout_correction_metrics", "IS_LEVELS",
           "REJECTION_MODES", "RATIO_BOUND_MODES"]
