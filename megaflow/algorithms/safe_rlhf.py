"""Safe RLHF's PPO-Lagrangian: the combined advantage and the Lagrange multiplier.

Dai et al. 2023, "Safe RLHF: Safe Reinforcement Learning from Human Feedback" (ICLR 2024),
section 3.3: the constrained problem ``max_theta J_R(theta) s.t. J_C(theta) <= d`` (``J_C``
the expected episode cost, ``d`` the cost limit) becomes the min-max problem

    min_theta max_{lambda >= 0} [ -J_R(theta) + lambda * (J_C(theta) - d) ]          (eq. 10)

solved by alternating a PPO step on the policy with the combined advantage (the actor's
surrogate of eq. 31 in the appendix, normalised by ``1 + lambda`` so the advantage's scale
does not grow with lambda)

    A = (A_r - lambda * A_c) / (1 + lambda)

and a gradient-ascent step on the multiplier. Like the authors' code (PKU-Alignment/safe-rlhf,
``PPOLagTrainer``), the multiplier is kept as ``log lambda`` (so lambda stays > 0) and one
SGD step on the loss ``-(J_C - d) * exp(log lambda)`` is taken per training step:

    log lambda <- log lambda + lr * lambda * (J_C - d),     then log lambda <= log lambda_max

where ``J_C`` is the batch's mean episode cost. Pure functions and a small state object: no
torch.distributed, no global state.
"""
from __future__ import annotations

import math
from typing import Any

import torch


def lagrangian_advantages(reward_advantages: torch.Tensor, cost_advantages: torch.Tensor,
                          lam: float, response_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The PPO-Lagrangian advantage ``(A_r - lambda * A_c) / (1 + lambda)`` (Dai et al. 2023,
    section 3.3; the actor loss of safe-rlhf's ``PPOLagTrainer``).

    Args:
        reward_advantages: ``[B, R]`` advantages of the reward (e.g. GAE over the reward critic).
        cost_advantages: ``[B, R]`` advantages of the cost (GAE over the cost critic); a
            positive cost advantage means more cost than expected, so it lowers ``A``.
        lam: the Lagrange multiplier ``lambda >= 0`` (a float).
        response_mask: ``[B, R]`` optional; where it is 0 the result is 0.

    Returns:
        ``[B, R]`` tensor, the dtype of ``reward_advantages``.

    Raises:
        ValueError: shapes differ, or ``lam`` is negative or not finite.
    """
    if reward_advantages.shape != cost_advantages.shape:
        raise ValueError(f"reward_advantages {tuple(reward_advantages.shape)} and cost_advantages "
                         f"{tuple(cost_advantages.shape)} must have the same [B, R] shape")
    if not (math.isfinite(lam) and lam >= 0):
        raise ValueError(f"the Lagrange multiplier must be finite and >= 0, got {lam}")
    combined = (reward_advantages - lam * cost_advantages.to(reward_advantages.dtype)) / (1.0 + lam)
    if response_mask is not None:
        combined = torch.where(response_mask != 0, combined, torch.zeros_like(combined))
    return combined


def episode_costs(token_level_costs: torch.Tensor) -> torch.Tensor:
    """``[B]`` episode cost of each row: the sum of its ``[B, R]`` token-level costs."""
    return token_level_costs.sum(-1)


class LagrangeMultiplier:
    """lambda of the PPO-Lagrangian, updated by dual (gradient) ascent on ``J_C - d``.

    Stores ``log lambda``; :meth:`update` takes one SGD step of learning rate ``lr`` on the
    loss ``-(mean_cost - cost_limit) * exp(log lambda)`` (safe-rlhf's update), i.e.
    ``log lambda += lr * lambda * (mean_cost - cost_limit)``, then clips ``log lambda`` at
    ``log(lambda_max)`` when a maximum is given. lambda is therefore always > 0; it rises
    while the mean episode cost exceeds the limit and decays geometrically-like while below.

    Args:
        lambda_init: initial lambda (> 0).
        lr: learning rate of the ascent step on ``log lambda`` (> 0).
        cost_limit: ``d``, the episode-cost limit (cost units).
        lambda_max: upper bound of lambda (> 0), or None for none.

    Raises:
        ValueError: a non-positive ``lambda_init``, ``lr`` or ``lambda_max``.
    """

    def __init__(self, lambda_init: float, lr: float, cost_limit: float, lambda_max: float | None = None) -> None:
        for name, value in (("lambda_init", lambda_init), ("lr", lr)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"LagrangeMultiplier: {name} must be finite and > 0, got {value}")
        if lambda_max is not None and not (lambda_max > 0):
            raise ValueError(f"LagrangeMultiplier: lambda_max must be > 0 or None, got {lambda_max}")
        self.lr, self.cost_limit, self.lambda_max = float(lr), float(cost_limit), lambda_max
        self.log_lambda = self._clip(math.log(lambda_init))

    @property
    def value(self) -> float:
        """lambda = exp(log lambda)."""
        return math.exp(self.log_lambda)

    def _clip(self, log_lambda: float) -> float:
        return log_lambda if self.lambda_max is None else min(log_lambda, math.log(self.lambda_max))

    def update(self, mean_cost: float) -> float:
        """One dual-ascent step on the batch's mean episode cost ``J_C``; returns the new lambda.

        Raises:
            ValueError: ``mean_cost`` is not finite.
        """
        if not math.isfinite(mean_cost):
            raise ValueError(f"LagrangeMultiplier.update: the mean episode cost is {mean_cost}")
        self.log_lambda = self._clip(self.log_lambda + self.lr * self.value * (mean_cost - self.cost_limit))
        return self.value

    def state_dict(self) -> dict[str, Any]:
        """``{"log_lambda": float}`` (JSON; a Python float round-trips exactly)."""
        return {"log_lambda": self.log_lambda}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s ``log_lambda`` exactly.

        Raises:
            KeyError / ValueError: the state has no finite ``log_lambda``.
        """
        value = float(state["log_lambda"])
        if not math.isfinite(value):
            raise ValueError(f"LagrangeMultiplier: saved log_lambda is {value}")
        self.log_lambda = value


__all__ = ["lagrangian_advantages", "episode_costs", "LagrangeMultiplier"]
