"""Critic loss: clipped value regression for PPO."""
from __future__ import annotations

import torch

from megaflow.algorithms._checks import check_same_shape, check_tensor
from megaflow.algorithms.aggregation import Count, aggregate_loss
from megaflow.algorithms.masked import masked_mean


def clipped_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    cliprange_value: float | None,
    loss_agg_mode: str = "token-mean",
    global_num_tokens: Count | None = None,
    global_num_seqs: Count | None = None,
    norm_length: int | float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO value loss with the value-clipping trick.

    ``V_clip = V_old + clip(V - V_old, -eps_v, eps_v)`` and
    ``L = 1/2 * max((V - R)^2, (V_clip - R)^2)`` per token (OpenAI baselines ``ppo2``;
    analysed as "value function clipping" in Engstrom et al. 2020, "Implementation
    Matters in Deep Policy Gradients", and Andrychowicz et al. 2021, "What Matters in
    On-Policy RL"), aggregated by :func:`megaflow.algorithms.aggregation.aggregate_loss`.
    With ``cliprange_value=None`` it is the plain ``1/2 (V - R)^2``.

    Args:
        values: ``[batch, response_len]`` current critic values (with gradient).
        old_values: same shape, values when the rollout was scored.
        returns: same shape, regression targets (e.g. GAE returns).
        response_mask: same shape, non-zero = valid.
        cliprange_value: ``eps_v`` >= 0 (in reward units), or None for no clipping.
        loss_agg_mode, global_num_tokens, global_num_seqs, norm_length: see ``aggregate_loss``.

    Returns:
        ``(loss, metrics)``; metrics (detached, token means over valid tokens):
        ``vf_clipfrac`` (tokens where the clipped branch is strictly larger, i.e. the
        gradient is cut), ``vpred_mean`` (mean of ``values``), ``vf_explained_var``
        (``1 - Var(R - V) / Var(R)``, 0 when ``Var(R) = 0``).

    Raises:
        ValueError: shape mismatch, negative ``cliprange_value``, unknown mode.
    """
    check_tensor("values", values, ndim=2)
    check_same_shape("values", values, old_values=old_values, returns=returns, response_mask=response_mask)
    if cliprange_value is not None and not cliprange_value >= 0:
        raise ValueError(f"cliprange_value must be >= 0 or None, got {cliprange_value!r}")
    valid = response_mask.to(values.device) != 0
    values, old_values, returns = (
        torch.where(valid, t, torch.zeros_like(t)) for t in (values, old_values, returns)
    )

    loss_unclipped = (values - returns).square()
    if cliprange_value is None:
        loss_mat, clipped = 0.5 * loss_unclipped, torch.zeros_like(valid)
    else:
        values_clipped = old_values + torch.clamp(values - old_values, -cliprange_value, cliprange_value)
        loss_clipped = (values_clipped - returns).square()
        loss_mat = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped
    loss = aggregate_loss(
        loss_mat, response_mask, loss_agg_mode,
        global_num_tokens=global_num_tokens, global_num_seqs=global_num_seqs, norm_length=norm_length,
    )
    with torch.no_grad():
        detached = values.detach()
        returns_mean = masked_mean(returns, valid)
        var_returns = masked_mean((returns - returns_mean).square(), valid)
        residual = returns - detached
        var_residual = masked_mean((residual - masked_mean(residual, valid)).square(), valid)
        explained = torch.where(
            var_returns > 0, 1 - var_residual / var_returns.clamp_min(1e-30), torch.zeros_like(var_returns)
        )
        metrics = {
            "vf_clipfrac": masked_mean(clipped.to(values.dtype), valid),
            "vpred_mean": masked_mean(detached, valid),
            "vf_explained_var": explained,
        }
    return loss, metrics
