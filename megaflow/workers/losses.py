"""Thin adapters from :mod:`megaflow.algorithms` losses to the engine's loss callback.

The engine calls ``loss_fn(outputs, micro_batch, denominators)`` per micro-batch and needs
(a) the micro-batch's share of the mini-batch loss (global denominators) and (b) metric
*shares* that add up over micro-batches and DP ranks. The algorithms return per-call token
means as metrics; a share is that mean times the micro-batch's fraction of the mini-batch's
valid tokens, so the sum is the mini-batch token mean.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from megaflow.algorithms import clipped_value_loss, compute_policy_loss, entropy_bonus, kl_loss, masked_mean
from megaflow.algorithms.off_policy import bypass_policy_loss, parse_rejection
from megaflow.config.schema import POLICY_LOSS_KEYS
from megaflow.megatron.denominators import GlobalDenominators

if TYPE_CHECKING:
    from megaflow.config.schema import Config


def _aggregation(mode: str, norm_length, den: GlobalDenominators) -> dict:
    return dict(loss_agg_mode=mode, global_num_tokens=den.num_tokens,
                global_num_seqs=den.num_seqs, norm_length=norm_length)


def _shares(prefix: str, metrics: dict, mask: torch.Tensor, den: GlobalDenominators) -> dict:
    weight = float((mask != 0).sum()) / max(den.num_tokens, 1)
    return {f"{prefix}/{k}": torch.as_tensor(v).detach().double() * weight for k, v in metrics.items()}


def needs_entropy(cfg: Config) -> bool:
    """Whether the actor's update needs the entropy output (``actor.entropy_coeff != 0``)."""
    return cfg.actor.entropy_coeff != 0.0


def _bypass_settings(cfg: Config) -> dict | None:
    """Keywords of :func:`megaflow.algorithms.off_policy.bypass_policy_loss` when
    ``algorithm.rollout_correction`` makes the actor's loss the bypass loss, else None."""
    rc, actor = cfg.algorithm.rollout_correction, cfg.actor
    if not rc.bypass_loss:
        return None
    return dict(loss_type=rc.bypass_loss_type, is_level=None if rc.is_level == "none" else rc.is_level,
                is_threshold=rc.is_threshold, is_batch_normalize=rc.is_batch_normalize,
                rejection=(parse_rejection(rc.rs, rc.rs_threshold)
                           if rc.rs is not None and rc.rs_threshold is not None else None),  # (set together)
                weights_over_kept=rc.is_weight_tokens == "kept", clip_ratio_low=actor.clip_ratio_low,
                clip_ratio_high=actor.clip_ratio_high, clip_ratio_c=actor.clip_ratio_c)


def actor_loss_fn(cfg: Config) -> Callable:
    """``pg_loss - entropy_coeff * entropy + kl_loss_coef * kl`` (any ``actor.policy_loss``; GRPO KL loss).

    Reads ``actor.policy_loss`` and the actor keys that loss reads
    (:data:`megaflow.config.schema.POLICY_LOSS_KEYS`: clip ranges, SAPO's temperatures, ...), ``loss_agg_mode``,
    ``entropy_coeff``, ``algorithm.use_kl_loss``/``kl_loss_coef``/``kl_loss_type``, and
    ``rollout.response_length`` as the ``seq-mean-token-sum-norm`` constant. A micro-batch
    field ``rollout_is_weights`` (rollout correction) multiplies the per-token policy loss;
    rejected tokens arrive already removed from ``response_mask``. With
    ``actor.on_policy_old_log_probs`` the old log-probs are the detached ``outputs["log_probs"]``
    (ratio exactly 1: approx KL and clip fraction 0), and ``training/rollout_probs_diff_mean``
    (token mean of ``|pi_old - pi_rollout|``) is computed here from a micro-batch field
    ``rollout_log_probs``, since the controller then has no old log-probs. In bypass mode with
    weights, ``rs`` or ``bypass_loss_type=reinforce`` the policy loss is verl's bypass loss
    (:func:`megaflow.algorithms.off_policy.bypass_policy_loss`): weights and rejection from the
    current vs the rollout log-probs, per micro-batch, over the engine's pre-rejection
    denominators; ``is_batch_normalize`` then normalises over the micro-batch.
    """
    actor, algo, norm_length = cfg.actor, cfg.algorithm, cfg.rollout.response_length
    with_entropy = needs_entropy(cfg)
    on_policy = actor.on_policy_old_log_probs
    loss_keys = {key: getattr(actor, key) for key in POLICY_LOSS_KEYS[actor.policy_loss]}
    bypass = _bypass_settings(cfg)

    def loss_fn(outputs: dict, mb: dict, den: GlobalDenominators):
        mask = mb["response_mask"]
        agg = _aggregation(actor.loss_agg_mode, norm_length, den)
        old = outputs["log_probs"].detach() if on_policy else mb["old_log_probs"]
        if bypass is not None:  # old = rollout: verl's bypass loss (weights / rejection recomputed here)
            pg, pg_metrics = bypass_policy_loss(outputs["log_probs"], old, mb["advantages"], mask, **bypass, **agg)
        else:
            pg, pg_metrics = compute_policy_loss(
                actor.policy_loss, outputs["log_probs"], old, mb["advantages"], mask,
                is_weights=mb.get("rollout_is_weights"), **loss_keys, **agg)
        loss, metrics = pg, {"actor/pg_loss": pg.detach()}
        metrics.update(_shares("actor", pg_metrics, mask, den))
        if on_policy and "rollout_log_probs" in mb:
            metrics.update(_shares("training", {"rollout_probs_diff_mean": masked_mean(
                (old.exp() - mb["rollout_log_probs"].exp()).abs(), mask)}, mask, den))
        if with_entropy:
            bonus, ent_metrics = entropy_bonus(outputs["entropy"], mask, **agg)
            loss = loss - actor.entropy_coeff * bonus
            metrics.update(_shares("actor", ent_metrics, mask, den))
        if algo.use_kl_loss:
            kl, kl_metrics = kl_loss(outputs["log_probs"], mb["ref_log_probs"], mask,
                                     kind=algo.kl_loss_type, **agg)
            loss = loss + algo.kl_loss_coef * kl
            metrics.update(_shares("actor", kl_metrics, mask, den))
        return loss, metrics

    return loss_fn


def critic_loss_fn(cfg: Config) -> Callable:
    """Clipped value loss against ``returns`` (old values = the batch's ``values``), reading
    ``critic.cliprange_value``, ``critic.loss_agg_mode`` and ``rollout.response_length``
    (the ``seq-mean-token-sum-norm`` constant)."""
    critic, norm_length = cfg.critic, cfg.rollout.response_length

    def loss_fn(outputs: dict, mb: dict, den: GlobalDenominators):
        mask = mb["response_mask"]
        loss, metrics = clipped_value_loss(
            outputs["values"], mb["values"], mb["returns"], mask,
            cliprange_value=critic.cliprange_value, **_aggregation(critic.loss_agg_mode, norm_length, den))
        shares = {"critic/vf_loss": loss.detach()}
        shares.update(_shares("critic", metrics, mask, den))
        return loss, shares

    return loss_fn


def mean_metrics(steps: list[dict], role: str) -> dict[str, float]:
    """Average per-step engine metrics over the mini-batch steps of one update.

    ``grad_norm``/``lr``/``loss`` get the role prefix (``actor/grad_norm``...); other keys
    are already prefixed by the loss adapters.
    """
    prefix = "critic" if role in ("critic", "cost_critic") else "actor"
    totals: dict[str, float] = {}
    for step in steps:
        for key, value in step.items():
            name = key if "/" in key else f"{prefix}/{key}"
            totals[name] = totals.get(name, 0.0) + float(value)
    return {k: v / max(len(steps), 1) for k, v in totals.items()}


__all__ = ["actor_loss_fn", "critic_loss_fn", "mean_metrics", "needs_entropy"]
