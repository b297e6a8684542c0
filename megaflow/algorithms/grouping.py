"""Group statistics for outcome-reward estimators (GRPO, RLOO, REINFORCE++-baseline).

Samples of one prompt share a ``uid`` (the trainer's ``non_tensor_batch["uid"]``);
these helpers turn such ids into a dense index and compute per-group statistics of a
per-sequence score, vectorised with ``scatter_add`` (no Python loop over groups).

Only *valid* rows count: a row whose response is empty (mask sum 0) is excluded from
its group's count, mean, variance and range, so it never changes a sibling's
advantage.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def group_index(group_ids: Sequence[Any] | np.ndarray | torch.Tensor, batch_size: int) -> torch.Tensor:
    """Map arbitrary hashable group ids to a dense ``[batch]`` int64 index (first-seen order).

    Args:
        group_ids: ``[batch]`` list, tuple, numpy array (object, str or int) or 1-D tensor
            of hashable ids (uids); equal ids form one group.
        batch_size: the expected length.

    Raises:
        ValueError: wrong length or not 1-D. TypeError: an id is not hashable.
    """
    if isinstance(group_ids, torch.Tensor):
        group_ids = group_ids.detach().cpu().numpy()
    ids = np.asarray(group_ids, dtype=object) if not isinstance(group_ids, np.ndarray) else group_ids
    if ids.ndim != 1 or len(ids) != batch_size:
        raise ValueError(
            f"group_ids must be 1-D with one id per row ({batch_size}), got shape {tuple(ids.shape)}"
        )
    dense: dict[Any, int] = {}
    try:
        index = [dense.setdefault(uid, len(dense)) for uid in ids.tolist()]
    except TypeError as err:
        raise TypeError(f"group_ids must hold hashable ids (e.g. str uids): {err}") from None
    return torch.tensor(index, dtype=torch.long)


@dataclass(frozen=True)
class GroupStats:
    """Per-row view of the statistics of the row's group (all ``[batch]``).

    Attributes:
        count: valid rows in the group.
        sum: sum of the valid rows' scores.
        mean: ``sum / count`` (0 for a group without valid rows).
        std: unbiased standard deviation (0 for ``count < 2``).
        constant: True when all valid scores of the group are exactly equal
            (including singleton groups); such groups carry no relative signal.
    """

    count: torch.Tensor
    sum: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor
    constant: torch.Tensor


def group_stats(scores: torch.Tensor, valid_rows: torch.Tensor, index: torch.Tensor) -> GroupStats:
    """Statistics of ``scores`` per group, gathered back to rows.

    Args:
        scores: ``[batch]`` floating per-sequence scores.
        valid_rows: ``[batch]`` bool, False rows are ignored everywhere.
        index: ``[batch]`` dense group index from :func:`group_index`.
    """
    index = index.to(scores.device)
    num_groups = int(index.max().item()) + 1 if index.numel() else 0
    weights = valid_rows.to(scores.dtype)
    safe_scores = torch.where(valid_rows, scores, torch.zeros_like(scores))

    def per_group(src: torch.Tensor) -> torch.Tensor:
        return torch.zeros(num_groups, dtype=src.dtype, device=src.device).scatter_add_(0, index, src)

    count = per_group(weights)
    total = per_group(safe_scores)
    mean = total / count.clamp_min(1)
    deviation = torch.where(valid_rows, scores - mean[index], torch.zeros_like(scores))
    var = per_group(deviation * deviation) / (count - 1).clamp_min(1)
    std = torch.where(count >= 2, var.sqrt(), torch.zeros_like(var))

    high = torch.full((num_groups,), -torch.inf, dtype=scores.dtype, device=scores.device)
    low = torch.full((num_groups,), torch.inf, dtype=scores.dtype, device=scores.device)
    high.scatter_reduce_(0, index, torch.where(valid_rows, scores, -torch.inf), "amax")
    low.scatter_reduce_(0, index, torch.where(valid_rows, scores, torch.inf), "amin")
    constant = (high <= low) | (count < 2)

    return GroupStats(
        count=count[index], sum=total[index], mean=mean[index], std=std[index], constant=constant[index]
    )
