"""Dynamic sampling (DAPO, Yu et al. 2025, section 3.2): train only on informative groups.

Under a group estimator (GRPO, RLOO, ...) a prompt whose ``n`` responses all get the same
reward has zero advantage on every response: it carries no policy-gradient signal, yet it
costs the old/ref log-prob forwards and the update. DAPO drops such groups and samples
more prompts until the step holds the configured number of groups with reward variance.

Two pieces, independent of where the rollouts come from:

* :func:`split_groups`: a pure filter over one scored rollout batch (rows grouped by the
  ``uid`` non-tensor field), returning the uids of the informative and uninformative groups.
* :func:`fill_informative`: calls a "generate + reward" round function until enough
  informative groups were collected (or a cap of extra rounds is reached), and assembles
  the step's batch of exactly ``target_groups`` groups.

When the cap is reached with too few informative groups, the batch is completed with
the first uninformative groups so that every later stage sees the batch size
it was configured for; their advantages are zero, and ``filter_groups/padded_groups``
counts them.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np

from megaflow.protocol import DataProto
from megaflow.rewards.manager import REWARD_FIELD_PREFIX


def group_metric(batch: DataProto, metric: str) -> np.ndarray:
    """Per-row value whose spread inside a group decides whether the group is informative.

    Args:
        batch: a scored rollout batch of ``B`` rows.
        metric: ``"score"``: the sequence reward, ``token_level_scores.sum(-1)`` (the reward
            the advantages are computed from); any other name ``k``: the reward function's
            per-sample field ``reward_<k>`` (e.g. ``acc``, DAPO's choice).

    Returns:
        ``[B]`` float64 values.

    Raises:
        KeyError: ``metric`` names no field of the batch (the available ones are listed).
    """
    if metric == "score":
        return batch.tensors["token_level_scores"].sum(-1).double().numpy()
    field = REWARD_FIELD_PREFIX + metric
    if field not in batch.non_tensor_batch:
        known = ["score"] + sorted(k[len(REWARD_FIELD_PREFIX):] for k in batch.non_tensor_batch
                                   if k.startswith(REWARD_FIELD_PREFIX))
        raise KeyError(f"algorithm.filter_groups.metric={metric!r}: the reward function returned no such "
                       f"field; available: {', '.join(known)}")
    return np.asarray(batch.non_tensor_batch[field], dtype=np.float64)


def split_groups(batch: DataProto, metric: str = "score") -> tuple[list[str], list[str]]:
    """The batch's groups split into (informative, uninformative) uids, in first-row order.

    A group (the rows sharing a ``uid``) is informative when its metric values
    (:func:`group_metric`) are not all equal (max > min over its non-NaN values; a group
    whose values are all NaN is not informative).

    Raises:
        KeyError: no ``uid`` field, or an unknown ``metric``.
    """
    values = group_metric(batch, metric)
    uids = batch.non_tensor_batch["uid"]
    order = list(dict.fromkeys(uids.tolist()))
    informative: list[str] = []
    flat: list[str] = []
    for uid in order:
        group = values[uids == uid]
        group = group[~np.isnan(group)]
        (informative if group.size and group.max() > group.min() else flat).append(uid)
    return informative, flat


def select_groups(batch: DataProto, uids: list[str]) -> DataProto:
    """The rows of ``batch`` whose ``uid`` is in ``uids``, in the batch's row order."""
    mask = np.isin(batch.non_tensor_batch["uid"], np.asarray(uids, dtype=object))
    return batch[np.nonzero(mask)[0]]


def _align_reward_fields(batches: list[DataProto]) -> list[DataProto]:
    """Give every batch the union of the rounds' ``reward_*`` fields (NaN where a round's
    data sources did not return that key), so the rounds concatenate."""
    fields = sorted({k for b in batches for k in b.non_tensor_batch if k.startswith(REWARD_FIELD_PREFIX)})
    for b in batches:
        for k in fields:
            b.non_tensor_batch.setdefault(k, np.full(len(b), np.nan, dtype=object))
    return batches


def fill_informative(generate_round: Callable[[int], DataProto], target_groups: int, *,
                     max_extra_rounds: int, metric: str = "score") -> tuple[DataProto, dict[str, float]]:
    """Collect ``target_groups`` informative groups from successive generation rounds.

    Args:
        generate_round: ``round -> scored rollout batch`` (round 0 is the step's own
            prompts; each later round draws new prompts). Rows carry ``uid`` and the
            reward (``token_level_scores`` ``[B, R]``, ``reward_*`` fields).
        target_groups: groups (prompts) the step trains on (``data.train_batch_size``).
        max_extra_rounds: rounds allowed after round 0 (``algorithm.filter_groups.
            max_extra_rounds``); when exhausted the batch is completed with uninformative
            groups.
        metric: see :func:`group_metric`.

    Returns:
        ``(batch, metrics)``: exactly ``target_groups`` groups in generation order (the
        first ``target_groups`` informative ones, then as many uninformative ones as are
        missing) and ``filter_groups/*`` metrics:
        ``rounds`` (generation rounds run), ``generated_groups``, ``informative_groups``
        (over all rounds), ``kept_share`` (informative / generated), ``padded_groups``
        (uninformative groups in the batch), ``cap_reached`` (1.0 when the cap stopped
        the search short of the target).

    Raises:
        ValueError: ``target_groups < 1`` or ``max_extra_rounds < 0``.
    """
    if target_groups < 1 or max_extra_rounds < 0:
        raise ValueError(f"fill_informative: target_groups={target_groups} must be >= 1 and "
                         f"max_extra_rounds={max_extra_rounds} >= 0")
    rounds: list[DataProto] = []
    informative: list[str] = []
    flat: list[str] = []
    generated = 0
    while len(informative) < target_groups and len(rounds) <= max_extra_rounds:
        batch = generate_round(len(rounds))
        good, bad = split_groups(batch, metric)
        rounds.append(batch)
        informative += good
        flat += bad
        generated += len(good) + len(bad)
    short = max(0, target_groups - len(informative))
    chosen = informative[:target_groups] + flat[:short]
    all_rows = DataProto.concat(_align_reward_fields(rounds)) if len(rounds) > 1 else rounds[0]
    batch = select_groups(all_rows, chosen)
    metrics = {"filter_groups/rounds": float(len(rounds)), "filter_groups/generated_groups": float(generated),
               "filter_groups/informative_groups": float(len(informative)),
               "filter_groups/kept_share": len(informative) / generated,
               "filter_groups/padded_groups": float(min(short, len(flat))),
               "filter_groups/cap_reached": float(short > 0)}
    return batch, metrics


__all__ = ["group_metric", "split_groups", "select_groups", "fill_informative"]
