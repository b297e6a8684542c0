"""The controller's light math on a step's batch: the generate request and its join, layout
check, KL in the reward, advantages, batch balancing, rollout correction, batch metrics.

These run on the controller between worker-group calls (the step in :mod:`megaflow.trainer.ppo_trainer`). Each is a
function of a :class:`~megaflow.protocol.DataProto` and plain settings, so the trainer's
step reads as a list of stages and each stage is tested on its own.
"""
from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from megaflow.algorithms import apply_kl_penalty, compute_advantages, masked_mean
from megaflow.protocol import DataProto

if TYPE_CHECKING:
    from megaflow.config.schema import RolloutConfig
    from megaflow.single_controller import GroupProtoResult

#: The prompt tensors the rollout's outputs replace (its ``input_ids``, ``attention_mask``
#: and ``position_ids`` cover prompt and response).
ROLLOUT_REPLACES = ("input_ids", "attention_mask", "position_ids")
#: The prompt tensors the rollout reads, ``[B, P]`` (left-padded; the engine takes each
#: row's real tokens and numbers positions itself).
PROMPT_KEYS = ("input_ids", "attention_mask")


# ---------------------------------------------------------------------------- the rollout call
def sampling_params(rollout: RolloutConfig, *, run_seed: int, step: int, greedy: bool) -> dict[str, Any]:
    """The rollout's sampling parameters for one generate call (its ``meta_info``).

    The seed changes every step so samples differ across steps but are reproducible (and
    identical on the ranks of one generation TP group) for a given run seed:
    ``seed = trainer.seed * 100003 + step``; ``step``: the step the samples are for (one
    step off, the next step's batch is requested during the current step).

    Args:
        rollout: the ``rollout`` section (temperature, top_p, top_k, response_length).
        run_seed: ``trainer.seed``.
        step: the training step the samples are for.
        greedy: decode greedily (validation, ReMax's baseline) instead of sampling.
    """
    return {"temperature": 0.0 if greedy else rollout.temperature, "top_p": 1.0 if greedy else rollout.top_p,
            "top_k": -1 if greedy else rollout.top_k, "response_length": rollout.response_length,
            "do_sample": not greedy, "seed": run_seed * 100_003 + step}


def generation_request(prompts: DataProto, n: int, sampling: dict[str, Any],
                       non_tensor_keys: Sequence[str] = ()) -> tuple[DataProto, DataProto]:
    """``(prompts with a uid per prompt, the generate call's input)``.

    The generate call's input holds the prompt tensors :data:`PROMPT_KEYS` ``[B, P]``
    repeated ``n`` times (interleaved: the samples of prompt ``i`` are rows ``i*n .. i*n+n-1``),
    those of ``non_tensor_keys`` the prompts have (multi-turn rollouts read the messages and
    tools: :data:`~megaflow.agent.vllm_agent.AGENT_INPUT_KEYS`), and ``sampling``
    (:func:`sampling_params`) as ``meta_info``.
    Prompts that already carry ``uid`` keep it.

    Raises:
        KeyError: the prompts lack ``input_ids`` or ``attention_mask``.
    """
    if "uid" not in prompts.non_tensor_batch:
        uids = [uuid.uuid4().hex for _ in range(len(prompts))]
        prompts = prompts.union(DataProto.from_dict(non_tensors={"uid": uids}))
    present = set(prompts.batch.keys()) if prompts.batch is not None else set()
    missing = [k for k in PROMPT_KEYS if k not in present]
    if missing:
        raise KeyError(f"generate_sequences reads {missing}, which the prompts lack; they have {sorted(present)}")
    keep = [k for k in non_tensor_keys if k in prompts.non_tensor_batch]
    gen_in = prompts.select(batch_keys=list(PROMPT_KEYS), non_tensor_keys=keep, meta_info_keys=[])
    gen_in = gen_in.repeat(n, interleave=True)
    gen_in.meta_info.update(sampling)
    return prompts, gen_in


def rollout_metrics(per_replica: list[dict[str, float]]) -> dict[str, float]:
    """A generate call's metrics from its per-replica results: generation replica 0's
    (the sync checked that every engine serves the same weight version), with
    ``timeline/gen_start_unix`` / ``timeline/gen_end_unix`` spanning all replicas (the
    earliest start, the latest end) when the replicas report them."""
    metrics = {k: float(v) for k, v in per_replica[0].items()}
    if "timeline/gen_start_unix" in metrics:
        metrics["timeline/gen_start_unix"] = min(m["timeline/gen_start_unix"] for m in per_replica)
        metrics["timeline/gen_end_unix"] = max(m["timeline/gen_end_unix"] for m in per_replica)
    return metrics


def join_rollout(prompts: DataProto, out: GroupProtoResult, n: int) -> tuple[DataProto, dict[str, float]]:
    """The prompts' other fields joined with the rollout's rows, and the rollout's metrics.

    Args:
        prompts: ``B`` prompts (as returned by :func:`generation_request`).
        out: the generate call's rows (``B * n``, interleaved) and per-replica metrics.
        n: samples per prompt.

    Returns:
        The prompts' non-tensor fields and tensor fields other than :data:`ROLLOUT_REPLACES`,
        repeated ``n`` times, joined with the rollout's rows (``meta_info`` dropped: the
        sampling parameters stay with the call); and :func:`rollout_metrics`, plus the
        ``agent/*`` metrics of multi-turn rows (:func:`agent_metrics`).
    """
    kept = [k for k in prompts.tensors.keys() if isinstance(k, str) and k not in ROLLOUT_REPLACES]
    rest = prompts.select(batch_keys=kept)
    rest = rest.repeat(n, interleave=True)
    if rest.batch is not None and len(rest.batch.keys()) == 0:
        rest.batch = None
    rows = DataProto(out.batch.batch, out.batch.non_tensor_batch, {})
    return rest.union(rows), {**rollout_metrics(out.metrics), **agent_metrics(rows)}


def agent_metrics(rows: DataProto) -> dict[str, float]:
    """The ``agent/*`` metrics (:func:`~megaflow.agent.metrics.trajectory_metrics`) of a rollout
    batch's multi-turn rows (its ``agent_*`` columns); empty for single-turn rows."""
    if "agent_turns" not in rows.non_tensor_batch:
        return {}
    from megaflow.agent.metrics import batch_counts, trajectory_metrics

    width = rows.tensors["responses"].shape[1]
    response_tokens = rows.tensors["attention_mask"][:, -width:].sum(-1).tolist()
    return trajectory_metrics(batch_counts(rows.non_tensor_batch, response_tokens))


def prompts_of(batch: DataProto, n: int) -> DataProto:
    """The prompts a rollout batch was generated from: every ``n``-th row's ``prompts``
    ``[B, P]`` as ``input_ids`` and the first ``P`` columns of its ``attention_mask``, with
    the rows' non-tensor fields (the inverse of the interleaved repeat of
    :func:`generation_request`, for ReMax's greedy baseline).

    Raises:
        KeyError: the batch has no ``prompts`` or ``attention_mask``.
    """
    rows = torch.arange(0, len(batch), n)
    prompt_ids = batch.tensors["prompts"][rows]
    mask = batch.tensors["attention_mask"][rows, : prompt_ids.shape[1]]
    return DataProto.from_dict({"input_ids": prompt_ids, "attention_mask": mask},
                               {k: v[rows.numpy()] for k, v in batch.non_tensor_batch.items()})


def kl_in_reward(batch: DataProto, kl_ctrl: Any, kind: str) -> tuple[DataProto, dict[str, float]]:
    """``token_level_rewards = token_level_scores - beta * KL(old || ref)`` per valid token.

    Needs ``token_level_scores``, ``old_log_probs``, ``ref_log_probs``, ``response_mask``
    (all ``[B, R]``). Updates the KL controller with the batch's KL (Ziegler et al. 2019).
    """
    b = batch.tensors
    rewards, metrics = apply_kl_penalty(b["token_level_scores"], b["old_log_probs"], b["ref_log_probs"],
                                        b["response_mask"], kl_ctrl.value, kind)
    kl_ctrl.update(metrics["kl"], n_steps=len(batch))
    out = DataProto.from_dict({"token_level_rewards": rewards})
    return batch.union(out), {"actor/reward_kl_penalty": metrics["kl"],
                              "actor/reward_kl_penalty_coeff": metrics["kl_coef"]}


def scores_as_rewards(batch: DataProto) -> tuple[DataProto, dict[str, float]]:
    """No KL in the reward: ``token_level_rewards = token_level_scores``."""
    out = DataProto.from_dict({"token_level_rewards": batch.tensors["token_level_scores"].clone()})
    return batch.union(out), {}


def check_rollout_batch(batch: DataProto) -> None:
    """Check the layout of a rollout's batch once on the controller (every later worker call
    relies on it; the workers send no ``position_ids`` to Megatron).

    Layout (verl's, :mod:`megaflow.protocol`): ``input_ids``/``attention_mask``/``position_ids``
    ``[B, S]`` are a left-padded prompt followed by a right-padded response whose real tokens
    form one contiguous span, ``position_ids = cumsum(attention_mask) - 1`` on them;
    ``responses``/``response_mask`` ``[B, R]`` with ``responses == input_ids[:, -R:]`` on real
    tokens and ``response_mask`` only on real response tokens.

    Raises:
        ValueError: the first violated rule, naming the field and the first bad rows.
    """
    b = batch.batch
    missing = [k for k in ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")
               if b is None or k not in b.keys()]
    if missing or b is None:  # (no batch: every field is missing)
        raise ValueError(f"the rollout returned no {missing}")
    ids, mask, pos, resp, resp_mask = (b[k] for k in ("input_ids", "attention_mask", "position_ids", "responses",
                                                      "response_mask"))
    rows, seq = ids.shape
    width = resp.shape[1] if resp.ndim == 2 else -1
    if mask.shape != ids.shape or pos.shape != ids.shape or resp.shape[:1] != (rows,) or not 0 < width < seq \
            or resp_mask.shape != resp.shape:
        raise ValueError(f"rollout batch shapes: input_ids {tuple(ids.shape)}, attention_mask {tuple(mask.shape)}, "
                         f"position_ids {tuple(pos.shape)}, responses {tuple(resp.shape)}, response_mask "
                         f"{tuple(resp_mask.shape)}; expected [B, S] x3 and [B, R] x2 with 0 < R < S")

    def fail(rule: str, bad: torch.Tensor) -> None:
        rows_bad = bad.nonzero().flatten().tolist()
        if rows_bad:
            raise ValueError(f"rollout batch: {rule} (rows {rows_bad[:8]})")

    real = mask != 0
    starts = (real.long().diff(dim=1) == 1).sum(-1) + real[:, 0].long()
    fail("attention_mask must be 0/1 with one contiguous span of real tokens", ((mask != 0) & (mask != 1)).any(-1)
         | (starts != 1))
    fail("position_ids must be cumsum(attention_mask) - 1 on real tokens",
         (real & (pos != mask.long().cumsum(-1) - 1)).any(-1))
    real_resp = real[:, seq - width:]
    fail(f"responses must equal input_ids[:, -{width}:] on real tokens",
         (real_resp & (resp != ids[:, seq - width:])).any(-1))
    fail("response_mask must be 0 on padding", ((resp_mask != 0) & ~real_resp).any(-1))


def add_advantages(batch: DataProto, estimator: str, *, gamma: float, lam: float,
                   norm_adv_by_std: bool) -> DataProto:
    """Add ``advantages`` and ``returns`` ``[B, R]`` with the named estimator
    (:func:`megaflow.algorithms.compute_advantages`).

    ``values`` (critic), ``uid`` (groups) and ``baseline_rewards`` (ReMax's greedy reward,
    ``[B]``) are passed when present; the estimator decides which it needs and raises a
    clear error for a missing one.
    """
    b = batch.tensors
    keys = b.keys()
    advantages, returns = compute_advantages(
        estimator,
        token_level_rewards=b["token_level_rewards"],
        response_mask=b["response_mask"],
        values=b["values"] if "values" in keys else None,
        group_ids=batch.non_tensor_batch.get("uid"),
        baseline_rewards=b["baseline_rewards"] if "baseline_rewards" in keys else None,
        gamma=gamma, lam=lam, norm_by_std=norm_adv_by_std)
    return batch.union(DataProto.from_dict({"advantages": advantages, "returns": returns}))


def balanced_dp_order(lengths: torch.Tensor, dp_size: int) -> torch.Tensor:
    """A row order whose ``dp_size`` contiguous equal chunks carry near-equal token totals.

    The dispatch gives DP rank ``d`` the ``d``-th contiguous chunk of the batch; reordering
    the rows by this permutation first balances the ranks' work (sequence-length balancing,
    verl's ``balance_batch``). Longest-processing-time greedy (Graham 1969): rows in order of
    decreasing length, each to the rank with the fewest tokens among those with room (every
    rank gets exactly ``rows / dp_size`` rows). Within a rank, rows keep their batch order.

    Args:
        lengths: ``[rows]`` tokens per row (attention-mask sums).
        dp_size: number of DP ranks; must divide ``rows``.

    Returns:
        int64 ``[rows]``: the batch's rows in their new order.

    Raises:
        ValueError: ``rows`` not divisible by ``dp_size``.
    """
    rows = len(lengths)
    if dp_size < 1 or rows % dp_size:
        raise ValueError(f"{rows} rows do not split evenly over dp_size={dp_size}")
    per_rank = rows // dp_size
    totals = [0] * dp_size
    members: list[list[int]] = [[] for _ in range(dp_size)]
    for row in torch.sort(lengths, descending=True, stable=True).indices.tolist():
        rank = min((r for r in range(dp_size) if len(members[r]) < per_rank), key=lambda r: (totals[r], r))
        members[rank].append(row)
        totals[rank] += int(lengths[row])
    return torch.tensor([row for m in members for row in sorted(m)], dtype=torch.int64)


def balance_batch(batch: DataProto, dp_size: int) -> tuple[DataProto, dict[str, float]]:
    """Reorder ``batch`` with :func:`balanced_dp_order` on its ``attention_mask`` lengths.

    Returns the reordered batch and ``perf/dp_tokens_imbalance`` (max / mean tokens per rank,
    1 = perfectly balanced).
    """
    lengths = batch.tensors["attention_mask"].sum(-1)
    order = balanced_dp_order(lengths, dp_size)
    per_rank = lengths[order].reshape(dp_size, -1).sum(-1).float()
    return batch[order], {"perf/dp_tokens_imbalance": float(per_rank.max() / per_rank.mean().clamp_min(1))}


class RolloutMismatchError(RuntimeError):
    """The rollout-vs-trainer log-prob gap exceeded ``algorithm.rollout_correction.max_mismatch``."""


def bypass_old_log_probs(batch: DataProto) -> DataProto:
    """Bypass mode: ``old_log_probs = rollout_log_probs`` (pi_old = pi_rollout), no forward pass.

    Raises:
        KeyError: the rollout returned no ``rollout_log_probs``.
    """
    if "rollout_log_probs" not in batch.tensors.keys():
        raise KeyError("bypass mode needs the rollout's rollout_log_probs")
    return batch.union(DataProto.from_dict({"old_log_probs": batch.tensors["rollout_log_probs"].clone()}))


def _rejection(old: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor,
               rc: Any) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The kept mask of ``rc.rejection`` (one band) or ``rc.rs`` (verl's chained options; with
    verl's metrics), None without rejection; plus verl's off-policy metrics of the batch."""
    from megaflow.algorithms import rejection_mask
    from megaflow.algorithms.off_policy import chained_rejection_mask, offpolicy_metrics, parse_rejection

    metrics = offpolicy_metrics(old, rollout, mask) if bool((mask != 0).any()) else {}
    if rc.rs is not None:
        kept, rs_metrics = chained_rejection_mask(old, rollout, mask, parse_rejection(rc.rs, rc.rs_threshold))
        return kept, {**metrics, **rs_metrics}
    if rc.rejection != "none":
        return rejection_mask(old, rollout, mask, mode=rc.rejection, lower=rc.rejection_lower,
                              upper=rc.rejection_upper), metrics
    return None, metrics


def _weights(old: torch.Tensor, rollout: torch.Tensor, over: torch.Tensor, rc: Any) -> tuple[torch.Tensor, float]:
    """Truncated importance weights over the tokens of ``over`` (IcePop band on the raw ratios
    first, batch normalisation last, each when configured) and the normalisation divisor."""
    from megaflow.algorithms import importance_weights
    from megaflow.algorithms.off_policy import batch_normalize_weights, icepop_weight_band

    if rc.icepop_lower is None:
        weights = importance_weights(old, rollout, over, level=rc.is_level, threshold=rc.is_threshold)
    else:
        raw = importance_weights(old, rollout, over, level=rc.is_level, threshold=math.inf)
        weights = icepop_weight_band(raw, lower=rc.icepop_lower, upper=rc.icepop_upper).clamp_max(rc.is_threshold)
    if not rc.is_batch_normalize:
        return weights, 1.0
    return batch_normalize_weights(weights, over, per_sequence=rc.is_level != "token")


def rollout_correction(batch: DataProto, rc: Any, *, step: int) -> tuple[DataProto, dict[str, float]]:
    """Rollout-correction stage: the actor's batch and the step's mismatch metrics.

    With importance weights on, the actor's batch gains ``rollout_is_weights`` ``[B, R]``
    (detached, truncated); with rejection on, its ``response_mask`` has the rejected
    tokens removed, so they leave the actor's loss and its global denominators (the
    returned batch is for ``update_actor`` only; the caller keeps the full mask for
    everything else). Metrics (``rollout_corr/...``) are computed every step when both
    log-probs exist, whether or not a correction is on.

    Args:
        batch: needs ``old_log_probs``, ``rollout_log_probs``, ``response_mask``.
        rc: ``algorithm.rollout_correction`` (:class:`megaflow.config.schema.RolloutCorrectionConfig`).
        step: the training step (named by the mismatch gate's error).

    Raises:
        RolloutMismatchError: the mean mismatch exceeds ``rc.max_mismatch``.
    """
    from megaflow.algorithms import rollout_correction_metrics

    b = batch.tensors
    if "rollout_log_probs" not in b.keys() or "old_log_probs" not in b.keys():
        return batch, {}
    old, rollout, mask = b["old_log_probs"], b["rollout_log_probs"], b["response_mask"]
    if rc.bypass:  # old = rollout: any weights / rejection happen inside the actor's (bypass) loss
        return batch, {f"rollout_corr/{k}": v for k, v in rollout_correction_metrics(old, rollout, mask).items()}
    extra: dict[str, torch.Tensor] = {}
    kept, verl_metrics = _rejection(old, rollout, mask, rc)
    weights = None
    if rc.is_level != "none":
        weights, factor = _weights(old, rollout, mask if kept is None or rc.is_weight_tokens == "valid" else kept, rc)
        extra["rollout_is_weights"] = weights
        if rc.is_batch_normalize:
            verl_metrics["rollout_is_batch_norm_factor"] = factor
    stats = rollout_correction_metrics(old, rollout, mask, weights=weights, kept_mask=kept)
    if rc.max_mismatch is not None and stats["mismatch_mean"] > rc.max_mismatch:
        raise RolloutMismatchError(
            f"step {step}: the mean |log pi_old - log pi_rollout| over the batch is {stats['mismatch_mean']:.3g} "
            f"nats (max {stats['mismatch_max']:.3g}), above algorithm.rollout_correction.max_mismatch="
            f"{rc.max_mismatch}; the rollout engine no longer samples the policy being trained")
    metrics = {f"rollout_corr/{k}": v for k, v in {**stats, **verl_metrics}.items()}
    if not extra and kept is None:
        return batch, metrics
    actor_batch = DataProto(batch=batch.tensors.clone(recurse=False), non_tensor_batch=dict(batch.non_tensor_batch),
                            meta_info=dict(batch.meta_info))
    for key, value in extra.items():
        actor_batch.tensors[key] = value
    if kept is not None:
        actor_batch.tensors["response_mask"] = kept
    return actor_batch, metrics


def _stats(prefix: str, x: torch.Tensor) -> dict[str, float]:
    if x.numel() == 0:
        return {}
    x = x.float()
    return {f"{prefix}/mean": x.mean().item(), f"{prefix}/max": x.max().item(),
            f"{prefix}/min": x.min().item()}


def _routing_metrics(tensors: Any, mask: torch.Tensor) -> dict[str, float]:
    """``moe/routing_agreement``: the fraction of (response token, MoE layer) pairs where the
    rollout engine's top-k expert set (``routed_experts``) equals the trainer's router's at the
    old-log-prob forward (``old_routed_experts``; with R3 the choice each router makes at the
    replayed layer inputs), response-mask tokens only
    (:func:`megaflow.algorithms.routing_agreement`); empty without both fields."""
    from megaflow.algorithms import routing_agreement
    from megaflow.megatron.batch import OLD_ROUTED_EXPERTS_KEY, ROUTED_EXPERTS_KEY

    if ROUTED_EXPERTS_KEY not in tensors.keys() or OLD_ROUTED_EXPERTS_KEY not in tensors.keys():
        return {}
    agreeing, counted = routing_agreement(tensors[ROUTED_EXPERTS_KEY], tensors[OLD_ROUTED_EXPERTS_KEY], mask)
    return {"moe/routing_agreement": agreeing / counted} if counted else {}


def compute_data_metrics(batch: DataProto, max_response_length: int) -> dict[str, float]:
    """Per-step metrics of the batch: scores, rewards, advantages, lengths, train/rollout gap.

    ``response_length/clip_ratio`` is the fraction of responses that hit
    ``max_response_length`` (no EOS). ``training/rollout_probs_diff_*`` compares the
    trainer's recomputed ``old_log_probs`` with the engine's ``rollout_log_probs`` on valid
    tokens (absolute difference of probabilities), the standard check that rollout and
    training agree (the log-prob gap is ``rollout_corr/mismatch_mean``, :func:`rollout_correction`).
    ``moe/routing_agreement`` (a mixture-of-experts actor whose batch has both the engine's and
    the trainer's routing): see :func:`_routing_metrics`.
    """
    b = batch.tensors
    mask = b["response_mask"].bool()
    seq_scores = b["token_level_scores"].sum(-1)
    seq_rewards = b["token_level_rewards"].sum(-1) if "token_level_rewards" in b.keys() else seq_scores
    lengths = mask.sum(-1).float()
    metrics = {"critic/score/std": seq_scores.float().std().item() if len(batch) > 1 else 0.0}
    metrics.update(_stats("critic/score", seq_scores))
    metrics.update(_stats("critic/rewards", seq_rewards))
    if "advantages" in b.keys():
        metrics.update(_stats("critic/advantages", b["advantages"][mask]))
        metrics.update(_stats("critic/returns", b["returns"][mask]))
    if "values" in b.keys():
        metrics.update(_stats("critic/values", b["values"][mask]))
    metrics.update(_stats("response_length", lengths))
    metrics["response_length/clip_ratio"] = (lengths >= max_response_length).float().mean().item()
    if "prompts" in b.keys():
        metrics.update(_stats("prompt_length", (b["prompts"] != 0).sum(-1).float()
                              if "attention_mask" not in b.keys()
                              else b["attention_mask"][:, : b["prompts"].shape[1]].sum(-1).float()))
    if "rollout_log_probs" in b.keys() and "old_log_probs" in b.keys() and mask.any():
        diff = (b["old_log_probs"].exp() - b["rollout_log_probs"].exp()).abs()[mask]
        metrics["training/rollout_probs_diff_mean"] = diff.mean().item()
        metrics["training/rollout_probs_diff_max"] = diff.max().item()
    metrics.update(_routing_metrics(b, mask))
    if "entropys" in b.keys():
        metrics["actor/entropy"] = masked_mean(b["entropys"], mask).item()
    if "data_source" in batch.non_tensor_batch:
        sources = batch.non_tensor_batch["data_source"]
        for src in np.unique(sources):
            sel = torch.as_tensor(sources == src)
            metrics[f"critic/score/{src}"] = seq_scores[sel].float().mean().item()
    return metrics


__all__ = ["sampling_params", "generation_request", "join_rollout", "rollout_metrics", "prompts_of",
           "ROLLOUT_REPLACES", "PROMPT_KEYS", "check_rollout_batch", "kl_in_reward", "scores_as_rewards",
           "add_advantages", "compute_data_metrics", "bypass_old_log_probs",
           "balanced_dp_order", "balance_batch",
           "rollout_correction", "RolloutMismatchError"]
