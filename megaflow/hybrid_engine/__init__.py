"""3D-HybridEngine: layout planning (pure) and micro-DP all-gather resharding (execution).

See DESIGN.md section 5. ``layout`` computes the generation layout, rank groups, slice
plans and the cost model without processes; ``reshard`` executes the train <-> generate
transitions with explicit process groups.
"""
from megaflow.config.hybrid_layout import (GenShardPlan, HybridLayout, ParamSpec, RankPlacement, ReshardCost,
                     SlicePiece, plan_hybrid_layout, plan_param_slices, reshard_cost)
from .reshard import (MicroDPResharder, ReshardGroups, ReshardStats, build_reshard_groups,
                      gather_layout_to_shard)

__all__ = [
    "GenShardPlan", "HybridLayout", "ParamSpec", "RankPlacement", "ReshardCost", "SlicePiece",
    "plan_hybrid_layout", "plan_param_slices", "reshard_cost",
    "MicroDPResharder", "ReshardGroups", "ReshardStats", "build_reshard_groups",
    "gather_layout_to_shard",
]
