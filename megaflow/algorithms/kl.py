"""KL estimators, KL controllers, KL as a reward penalty and KL as a loss term.

Per-token estimators of ``KL(pi_theta || pi_ref)`` from the log-probs of the sampled
tokens (Schulman 2020, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html),
with ``x = log_probs - ref_log_probs`` (log of ``pi_theta / pi_ref`` at the sampled token):

* ``"k1"``: ``x`` (unbiased, high variance, can be negative).
* ``"abs"``: ``|x|``.
* ``"k2"`` / ``"mse"``: ``x^2 / 2`` (biased, low variance, always >= 0).
* ``"k3"`` / ``"low_var_kl"``: ``exp(-x) - 1 + x`` (unbiased, >= 0, low variance). For
  stability ``-x`` is clamped to [-20, 20] before ``exp`` and the result to [-10, 10]
  (outside, the gradient is 0).

Straight-through variants ``"k1+"``, ``"abs+"``, ``"k3+"``, ``"low_var_kl+"``: the *value*
of the named estimator and the *gradient* of ``"k2"``, i.e. ``d/d log_probs = x``. On
tokens sampled from ``pi_theta``, ``E[x * grad log pi_theta]`` is the exact gradient of
``KL(pi_theta || pi_ref)``, whereas the gradient of k1 is 0 in expectation and that of
k3 is biased; so "+" logs/penalises the chosen estimator's value while optimising the
true KL. ``"k2"`` already has that gradient, so it has no "+" variant.
"""
from __future__ import annotations

import torch

from megaflow.algorithms._checks import check_choice, check_same_shape, check_tensor
from megaflow.algorithms.aggregation import Count, aggregate_loss
from megaflow.algorithms.masked import masked_mean

_BASE_KINDS = ("k1", "abs", "k2", "mse", "k3", "low_var_kl")
KL_KINDS: tuple[str, ...] = _BASE_KINDS + ("k1+", "abs+", "k3+", "low_var_kl+")


def _base_kl(log_ratio: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "k1":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind in ("k2", "mse"):
        return 0.5 * log_ratio.square()
    ref_log_ratio = torch.clamp(-log_ratio, min=-20.0, max=20.0)
    return torch.clamp(ref_log_ratio.exp() - 1.0 - ref_log_ratio, min=-10.0, max=10.0)


def kl_penalty(log_probs: torch.Tensor, ref_log_probs: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL estimate ``[batch, response_len]`` (see module docs for the kinds).

    Args:
        log_probs: ``[batch, response_len]`` log-probs of the sampled tokens under the
            policy (may carry gradient).
        ref_log_probs: same shape, under the reference policy.
        kind: one of :data:`KL_KINDS`.

    Returns:
        Unmasked per-token estimate; the caller masks and aggregates.

    Raises:
        ValueError: unknown kind (lists the valid ones) or mismatched shapes.
    """
    check_choice("KL kind", kind, KL_KINDS)
    check_tensor("log_probs", log_probs)
    check_same_shape("log_probs", log_probs, ref_log_probs=ref_log_probs)
    log_ratio = log_probs - ref_log_probs
    if not kind.endswith("+"):
        return _base_kl(log_ratio, kind)
    value = _base_kl(log_ratio, kind[:-1])
    surrogate = _base_kl(log_ratio, "k2")
    return surrogate - surrogate.detach() + value.detach()


class FixedKLController:
    """Constant KL coefficient ``beta`` (the ``update`` is a no-op)."""

    def __init__(self, kl_coef: float) -> None:
        if not kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef!r}")
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient (same signature as :class:`AdaptiveKLController`)."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of the KL coefficient, Ziegler et al. 2019, Sec. 2.2.

    "Fine-Tuning Language Models from Human Preferences" (arXiv:1909.08593):
    ``e_t = clip(KL_t / KL_target - 1, -0.2, 0.2)``, ``beta_{t+1} = beta_t * (1 + K_beta * e_t)``
    with ``K_beta = n_steps / horizon`` as in the paper's reference implementation
    (``n_steps``: samples consumed since the last update, ``horizon``: samples over which
    the error should be corrected; the paper's ``K_beta = 0.1``).

    Args:
        init_kl_coef: starting ``beta`` (>= 0).
        target_kl: ``KL_target`` (> 0), in the units of the measured KL (nats/token for
            the ``"kl"`` metric of :func:`apply_kl_penalty`).
        horizon: > 0.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float) -> None:
        if not init_kl_coef >= 0:
            raise ValueError(f"init_kl_coef must be >= 0, got {init_kl_coef!r}")
        if not target_kl > 0:
            raise ValueError(f"target_kl must be > 0, got {target_kl!r}")
        if not horizon > 0:
            raise ValueError(f"horizon must be > 0, got {horizon!r}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move ``value`` towards keeping ``current_kl`` at ``target_kl``."""
        proportional_error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


KL_CONTROLLERS: tuple[str, ...] = ("fixed", "adaptive")


def build_kl_controller(
    kind: str, *, kl_coef: float, target_kl: float | None = None, horizon: float | None = None
) -> FixedKLController | AdaptiveKLController:
    """Build a controller by name: ``"fixed"`` or ``"adaptive"`` (needs target_kl, horizon)."""
    check_choice("KL controller", kind, KL_CONTROLLERS)
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if target_kl is None or horizon is None:
        raise ValueError("the 'adaptive' KL controller requires target_kl and horizon")
    return AdaptiveKLController(kl_coef, target_kl, horizon)


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    kind: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL in the reward: ``r_t = score_t - beta * KL_t`` on valid tokens.

    Ziegler et al. 2019, Sec. 2.2 (``R = r - beta * log(pi / rho)``), applied per token as
    in PPO-RLHF (Ouyang et al. 2022). Runs without autograd.

    Args:
        token_level_scores: ``[batch, response_len]`` task rewards.
        log_probs: ``[batch, response_len]`` rollout-policy log-probs (``old_log_probs``).
        ref_log_probs: same shape, reference log-probs.
        response_mask: same shape, non-zero = valid.
        kl_coef: ``beta`` (e.g. ``controller.value``).
        kind: one of :data:`KL_KINDS` (the "+" variants equal their base here).

    Returns:
        ``(token_level_rewards, metrics)``. Rewards equal the scores at masked positions.
        ``metrics["kl"]``: mean over non-empty sequences of the per-sequence mean KL
        (nats/token; feed it to ``controller.update``); ``metrics["kl_coef"]``: ``beta``.
    """
    check_tensor("token_level_scores", token_level_scores, ndim=2)
    check_same_shape(
        "token_level_scores", token_level_scores,
        log_probs=log_probs, ref_log_probs=ref_log_probs, response_mask=response_mask,
    )
    with torch.no_grad():
        valid = response_mask != 0
        kl = kl_penalty(log_probs.detach(), ref_log_probs.detach(), kind)
        kl = torch.where(valid, kl, torch.zeros_like(kl)).to(token_level_scores.dtype)
        rewards = token_level_scores - kl_coef * kl
        per_seq = masked_mean(kl, valid, dim=-1)
        current_kl = masked_mean(per_seq, valid.any(dim=-1))
    return rewards, {"kl": float(current_kl), "kl_coef": float(kl_coef)}


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    norm_length: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL as a loss term (GRPO, Shao et al. 2024, eq. 3-4), to be *added* times its coef.

    Args:
        log_probs: ``[batch, response_len]`` current-policy log-probs (with gradient).
        ref_log_probs, response_mask: same shape.
        kind: one of :data:`KL_KINDS` (GRPO uses k3 = ``"low_var_kl"``).
        loss_agg_mode, global_num_tokens, global_num_seqs, norm_length: see
            :func:`megaflow.algorithms.aggregation.aggregate_loss`.

    Returns:
        ``(loss, metrics)``: aggregated KL (0-d, differentiable) and
        ``{"kl_loss": token-mean KL of this call}`` (detached 0-d tensor).
    """
    check_tensor("log_probs", log_probs, ndim=2)
    check_same_shape("log_probs", log_probs, ref_log_probs=ref_log_probs, response_mask=response_mask)
    valid = response_mask.to(log_probs.device) != 0
    # zero masked entries first so NaN/inf padding cannot leak into the gradient
    log_probs = torch.where(valid, log_probs, torch.zeros_like(log_probs))
    ref_log_probs = torch.where(valid, ref_log_probs, torch.zeros_like(ref_log_probs))
    kl = kl_penalty(log_probs, ref_log_probs, kind)
    loss = aggregate_loss(
        kl, response_mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length,
    )
    with torch.no_grad():
        metrics = {"kl_loss": masked_mean(kl.detach(), response_mask)}
    return loss, metrics
