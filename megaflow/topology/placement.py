"""Where ranks go: resource pools on the cluster's nodes and Megatron's process groups.

Pure functions on plain numbers; no processes. The generation layout of the
3D-HybridEngine is planned by :func:`megaflow.topology.hybrid_layout.plan_hybrid_layout`
(wrapped here by :func:`generation_layout`, which counts CP replicas as DP) so that the dry
run prints exactly the groups the workers build.
"""
from __future__ import annotations

from dataclasses import dataclass

from megaflow.config.schema import ResourcesConfig
from megaflow.config.typed import ConfigError
from megaflow.topology.hybrid_layout import HybridLayout, plan_hybrid_layout

Groups = tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class PoolPlacement:
    """A resource pool laid out on the cluster: ranks ``0..world_size-1`` of the pool are
    ordered by node, then by local index (rank ``r`` is on ``nodes[r // procs_per_node]``)."""

    name: str
    nodes: tuple[int, ...]
    procs_per_node: int

    @property
    def world_size(self) -> int:
        return len(self.nodes) * self.procs_per_node

    def node_of(self, rank: int) -> int:
        """Cluster node index of pool rank ``rank``."""
        return self.nodes[rank // self.procs_per_node]


def pack_pools(res: ResourcesConfig) -> dict[str, PoolPlacement]:
    """Lay the pools out on ``res.nodes`` nodes of ``res.procs_per_node`` slots each.

    Pools are placed in declaration order; each takes the first nodes that still have
    ``procs_per_node`` free slots (first fit), so small pools can share a node.

    Raises:
        ConfigError: (key ``pools.<name>...``, relative to ``resources``) a pool wants more
            ranks per node than a node has, or more nodes than remain free.
    """
    free = [res.procs_per_node] * res.nodes
    placed: dict[str, PoolPlacement] = {}
    for name in res.pools:
        nodes, procs = res.pool_nodes(name), res.pool_procs_per_node(name)
        if procs > res.procs_per_node:
            raise ConfigError(f"pools.{name}.procs_per_node",
                              f"{procs} ranks per node, but nodes have {{0}}={res.procs_per_node}",
                              ("procs_per_node",))
        candidates = [i for i, slots in enumerate(free) if slots >= procs][:nodes]
        if len(candidates) < nodes:
            before = f" after pools {', '.join(placed)}" if placed else ""
            raise ConfigError(f"pools.{name}",
                              f"needs {nodes} nodes with {procs} free ranks each; the cluster ({{0}}={res.nodes} "
                              f"x {{1}}={res.procs_per_node}) has only {len(candidates)}{before}",
                              ("nodes", "procs_per_node"))
        for i in candidates:
            free[i] -= procs
        placed[name] = PoolPlacement(name=name, nodes=tuple(candidates), procs_per_node=procs)
    return placed


@dataclass(frozen=True)
class MeshGroups:
    """Megatron's process groups of one role, as tuples of pool ranks.

    Rank order is megatron-core's default ``tp-cp-ep-dp-pp`` (tp fastest, ep = 1):
    ``rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))``.
    """

    tp_groups: Groups
    cp_groups: Groups
    dp_groups: Groups
    pp_groups: Groups


def megatron_groups(tp: int, pp: int, dp: int, cp: int = 1) -> MeshGroups:
    """All TP, CP, DP and PP groups of a ``tp*cp*dp*pp`` world (see :class:`MeshGroups`).

    Example (Megatron's own docstring example, 8 ranks, tp=2, pp=2, dp=2): TP groups
    ``[0,1] [2,3] [4,5] [6,7]``, DP groups ``[0,2] [1,3] [4,6] [5,7]``, PP groups
    ``[0,4] [1,5] [2,6] [3,7]``.
    """
    def rank(t: int, c: int, d: int, p: int) -> int:
        return t + tp * (c + cp * (d + dp * p))

    return MeshGroups(
        tp_groups=tuple(tuple(rank(t, c, d, p) for t in range(tp))
                        for p in range(pp) for d in range(dp) for c in range(cp)),
        cp_groups=tuple(tuple(rank(t, c, d, p) for c in range(cp))
                        for p in range(pp) for d in range(dp) for t in range(tp)),
        dp_groups=tuple(tuple(rank(t, c, d, p) for d in range(dp))
                        for p in range(pp) for c in range(cp) for t in range(tp)),
        pp_groups=tuple(tuple(rank(t, c, d, p) for p in range(pp))
                        for d in range(dp) for c in range(cp) for t in range(tp)),
    )


def generation_layout(tp: int, pp: int, dp: int, cp: int, gen_tp: int, gen_pp: int,
                      num_attention_heads: int, num_key_value_heads: int) -> HybridLayout:
    """The HybridEngine's generation layout of an actor mesh (:func:`plan_hybrid_layout`).

    Context-parallel ranks hold whole copies of their stage's weights, so with ``cp > 1``
    the ``cp * dp`` weight replicas act as the planner's DP dimension (the megatron rank
    formula is the same with ``dp_rank' = cp_rank + cp * dp_rank``).
    """
    return plan_hybrid_layout(tp, pp, dp * cp, gen_tp, gen_pp, num_attention_heads=num_attention_heads,
                              num_query_groups=num_key_value_heads)
