"""3D-HybridEngine: layout planning (pure) and micro-DP all-gather resharding (execution).

:mod:`megaflow.topology.hybrid_layout` computes the generation
layout, rank groups and the cost model without processes; ``reshard`` executes the
train <-> generate transitions with explicit process groups (the slicing rule lives there
once: the all-gather's slot layout and :func:`gather_layout_to_shard`);
``rollout_weights`` converts the generation shard into vLLM's layout, in buckets.
"""
from megaflow.topology.hybrid_layout import HybridLayout, RankPlacement, ReshardCost, plan_hybrid_layout, reshard_cost

from .reshard import MicroDPResharder, ReshardGroups, ReshardStats, build_reshard_groups, gather_layout_to_shard

__all__ = [
    "HybridLayout", "RankPlacement", "ReshardCost", "plan_hybrid_layout", "reshard_cost",
    "MicroDPResharder", "ReshardGroups", "ReshardStats", "build_reshard_groups",
    "gather_layout_to_shard",
]
