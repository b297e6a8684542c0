"""The Safe RLHF stages of the controller's step (``algorithm.safe_rlhf``; Dai et al. 2023).

The PPO step gains four stages, each a call from :meth:`RayPPOTrainer.train_step
<megaflow.trainer.ppo_trainer.RayPPOTrainer.train_step>` (the few lines the HybridFlow
design promises for a cost model and a Lagrangian):

1. after the reward: :meth:`SafeRLHF.add_costs`, the rule cost of every response
   (``token_level_costs`` ``[B, R]`` on its last valid token, :class:`~megaflow.rewards.cost.RuleCostManager`);
2. after the critic's values: :meth:`SafeRLHF.add_cost_values`, the cost critic's
   ``cost_values`` ``[B, R]``;
3. after the reward's advantages: :meth:`SafeRLHF.lagrangian_step`, the cost's GAE
   (``cost_advantages``, ``cost_returns``), one dual-ascent step of lambda on the batch's mean
   episode cost, and the actor's ``advantages`` replaced by ``(A_r - lambda A_c) / (1 + lambda)``
   (the reward's own are kept as ``reward_advantages``);
4. with the critic's update: :meth:`SafeRLHF.update_cost_critic`.

KL stays in the reward only (``algorithm.use_kl_in_reward``); the cost's GAE uses the
reward's ``gamma``, ``lam`` and whitening (``algorithm.norm_adv_by_std``), so both advantages
enter the combination on the same scale. lambda (as ``log lambda``) is saved in the trainer
state of every checkpoint and restored exactly.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megaflow.algorithms import compute_advantages, masked_mean
from megaflow.algorithms.safe_rlhf import LagrangeMultiplier, episode_costs, lagrangian_advantages
from megaflow.config.typed import ConfigError
from megaflow.protocol import DataProto
from megaflow.rewards.cost import COST_FUNCTIONS, RuleCostManager
from megaflow.rewards.manager import reward_metrics

if TYPE_CHECKING:
    from collections.abc import Callable

    from tensordict import TensorDict

    from megaflow.config import Config
    from megaflow.trainer.proxies import CostCriticProxy


def resolve_cost_function(cfg: Config) -> Callable[..., Any]:
    """``algorithm.safe_rlhf.cost_function``: a built-in (:data:`~megaflow.rewards.cost.COST_FUNCTIONS`)
    or the imported ``package.module:function``.

    Raises:
        ConfigError: at ``algorithm.safe_rlhf.cost_function``: the module does not import or
            has no such callable.
    """
    target = cfg.algorithm.safe_rlhf.cost_function
    if target in COST_FUNCTIONS:
        return COST_FUNCTIONS[target]
    module_name, _, attr = target.partition(":")
    key = "algorithm.safe_rlhf.cost_function"
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - user code: report what it raised, by name
        raise ConfigError(key, f"{target!r}: importing {module_name!r} raised {type(exc).__name__}: {exc}") \
            from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(key, f"{target!r}: module {module_name!r} has no function {attr!r}")
    return fn


def _tensors(batch: DataProto) -> TensorDict:
    """The batch's tensors (a step's batch always has them)."""
    if batch.batch is None:
        raise ValueError("Safe RLHF's stages need a batch with tensors")
    return batch.batch


class SafeRLHF:
    """The controller's Safe RLHF state and stages (see the module docstring).

    Args:
        cfg: the run's config (``algorithm.safe_rlhf.enable`` true).
        tokenizer: decodes responses for the rule cost.
        cost_fn: the cost function; None: :func:`resolve_cost_function`.
    """

    def __init__(self, cfg: Config, tokenizer: Any, cost_fn: Callable[..., Any] | None = None) -> None:
        sr, algo = cfg.algorithm.safe_rlhf, cfg.algorithm
        self.algo = algo
        self.multiplier = LagrangeMultiplier(sr.lambda_init, sr.lambda_lr, sr.cost_limit, sr.lambda_max)
        self.cost_fn = RuleCostManager(tokenizer, cost_fn or resolve_cost_function(cfg), sr.cost_kwargs)

    def add_costs(self, batch: DataProto) -> DataProto:
        """``token_level_costs`` ``[B, R]`` and the per-sample ``cost_*`` fields."""
        return batch.union(self.cost_fn(batch))

    def add_cost_values(self, batch: DataProto, cost_critic: CostCriticProxy) -> DataProto:
        """``cost_values`` ``[B, R]`` from the cost critic."""
        values = _tensors(cost_critic.compute_values(batch))["values"]
        return batch.union(DataProto.from_dict({"cost_values": values}))

    def lagrangian_step(self, batch: DataProto) -> tuple[DataProto, dict[str, float]]:
        """The cost's GAE, lambda's dual-ascent step, the combined advantages.

        Needs ``advantages`` (the reward's), ``token_level_costs``, ``cost_values``,
        ``response_mask``. Returns the batch with ``advantages`` = the Lagrangian advantage,
        ``reward_advantages``, ``cost_advantages``, ``cost_returns`` (all ``[B, R]``), and the
        ``safe/*`` metrics (lambda after the step, the mean episode cost, its gap to the limit).
        """
        b, algo = _tensors(batch), self.algo
        mask = b["response_mask"]
        cost_adv, cost_ret = compute_advantages("gae", token_level_rewards=b["token_level_costs"],
                                                response_mask=mask, values=b["cost_values"], gamma=algo.gamma,
                                                lam=algo.lam, norm_by_std=algo.norm_adv_by_std)
        mean_cost = float(episode_costs(b["token_level_costs"]).float().mean())
        lam_before = self.multiplier.value
        lam = self.multiplier.update(mean_cost)
        combined = lagrangian_advantages(b["advantages"], cost_adv, lam, mask)
        out = DataProto.from_dict({"reward_advantages": b["advantages"], "cost_advantages": cost_adv,
                                   "cost_returns": cost_ret})
        batch = batch.union(out)
        _tensors(batch)["advantages"] = combined
        metrics = {"safe/lambda": lam, "safe/lambda_before": lam_before, "safe/log_lambda": self.multiplier.log_lambda,
                   "safe/episode_cost/mean": mean_cost,
                   "safe/episode_cost/minus_limit": mean_cost - self.multiplier.cost_limit,
                   "safe/cost_advantages/mean": float(masked_mean(cost_adv, mask)),
                   "safe/cost_returns/mean": float(masked_mean(cost_ret, mask)),
                   "safe/cost_values/mean": float(masked_mean(b["cost_values"], mask))}
        metrics.update(reward_metrics(batch, prefix="cost", field_prefix="cost_"))
        return batch, metrics

    @staticmethod
    def update_cost_critic(batch: DataProto, cost_critic: CostCriticProxy) -> dict[str, float]:
        """Fit the cost critic to ``cost_returns`` (its old values ``cost_values``); the update's
        metrics as ``cost_critic/...``."""
        b = _tensors(batch)
        inputs = DataProto.from_dict({k: b[k] for k in ("input_ids", "attention_mask", "responses", "response_mask")}
                                     | {"values": b["cost_values"], "returns": b["cost_returns"]})
        per_rank = cost_critic.update_critic(inputs)
        return {"cost_critic/" + k.partition("/")[2]: float(v) for k, v in per_rank[0].items()}

    def state_dict(self) -> dict[str, Any]:
        """The multiplier's state (JSON)."""
        return {"multiplier": self.multiplier.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly."""
        self.multiplier.load_state_dict(state["multiplier"])


__all__ = ["SafeRLHF", "resolve_cost_function"]
