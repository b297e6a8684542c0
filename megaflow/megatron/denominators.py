"""The loss denominators of :class:`megaflow.megatron.engine.MegatronEngine`: one small
value type shared by the engine and the loss adapters (:mod:`megaflow.workers.losses`).

The engine has no settings object of its own: it reads the role's config sections through
:class:`megaflow.topology.role_spec.RoleSpec`.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class GlobalDenominators:
    """Counts over the whole mini-batch (all DP ranks and micro-batches) for loss aggregation.

    ``num_tokens``: valid tokens of the loss mask; ``num_seqs``: rows with >= 1 valid token
    (``megaflow.algorithms.aggregate_loss``'s ``global_num_tokens`` / ``global_num_seqs``).
    """

    num_tokens: int
    num_seqs: int


__all__ = ["GlobalDenominators"]
