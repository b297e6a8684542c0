"""``ResourcePool``: the processes of one or more worker groups, as Ray placement groups.

``ResourcePool(process_on_nodes=[4, 4])`` describes 8 ranks on 2 nodes. It becomes one
placement group per node (strategy ``STRICT_PACK``, so a node's ranks share a machine)
with one bundle per rank. Rank order is deterministic: node 0's bundles first, then
node 1's, each in bundle order.

Up to ``max_colocate_count`` worker groups can be created on one pool; each of their
actors takes ``1 / max_colocate_count`` of its bundle (GPU and CPU), so the groups share
the ranks' accelerators. Colocating roles inside *one* process per rank
(``create_colocated_worker_cls``) needs only ``max_colocate_count=1``.
"""
from __future__ import annotations

from collections.abc import Sequence

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group


class ResourcePool:
    """Ranks per node for worker groups, realised lazily as Ray placement groups.

    Args:
        process_on_nodes: number of ranks (processes) on each node, e.g. ``[8, 8]``.
        max_colocate_count: how many worker groups may share each rank's bundle.
        use_gpu: give every bundle one GPU.
        num_cpus_per_process: CPUs per bundle; may be fractional (e.g. ``0.5`` to
            oversubscribe a small machine in tests).
        name_prefix: prefix of the placement group names.
        ready_timeout_s: how long :meth:`placement_groups` waits for the cluster to grant
            the bundles before failing.

    Raises:
        TypeError / ValueError: invalid arguments (named in the message).
    """

    def __init__(self, process_on_nodes: Sequence[int], max_colocate_count: int = 1, use_gpu: bool = False,
                 num_cpus_per_process: float = 1.0, name_prefix: str = "megaflow",
                 ready_timeout_s: float = 300.0) -> None:
        if isinstance(process_on_nodes, (str, bytes)) or not isinstance(process_on_nodes, Sequence):
            raise TypeError(f"process_on_nodes must be a list of ranks per node, got {process_on_nodes!r}")
        if not process_on_nodes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                       for n in process_on_nodes):
            raise ValueError(f"process_on_nodes must be a non-empty list of ints >= 1, got {list(process_on_nodes)}")
        if isinstance(max_colocate_count, bool) or not isinstance(max_colocate_count, int) or max_colocate_count < 1:
            raise ValueError(f"max_colocate_count must be an int >= 1, got {max_colocate_count!r}")
        if not isinstance(num_cpus_per_process, (int, float)) or num_cpus_per_process <= 0:
            raise ValueError(f"num_cpus_per_process must be > 0, got {num_cpus_per_process!r}")
        if not isinstance(name_prefix, str) or not name_prefix:
            raise ValueError(f"name_prefix must be a non-empty string, got {name_prefix!r}")
        if ready_timeout_s <= 0:
            raise ValueError(f"ready_timeout_s must be > 0, got {ready_timeout_s!r}")
        self.process_on_nodes = tuple(process_on_nodes)
        self.max_colocate_count = max_colocate_count
        self.use_gpu = bool(use_gpu)
        self.num_cpus_per_process = float(num_cpus_per_process)
        self.name_prefix = name_prefix
        self.ready_timeout_s = float(ready_timeout_s)
        self._pgs: list[PlacementGroup] | None = None
        self._num_groups = 0

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return sum(self.process_on_nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.process_on_nodes)

    def rank_layout(self) -> list[tuple[int, int]]:
        """``(node_index, local_index)`` of every global rank, in rank order."""
        return [(node, local) for node, count in enumerate(self.process_on_nodes) for local in range(count)]

    def bundle(self) -> dict[str, float]:
        """Resources of one rank's bundle."""
        resources = {"CPU": self.num_cpus_per_process}
        if self.use_gpu:
            resources["GPU"] = 1.0
        return resources

    def actor_resources(self) -> dict[str, float]:
        """``ray.remote`` options for one actor: its share of a bundle."""
        share = {"num_cpus": self.num_cpus_per_process / self.max_colocate_count}
        if self.use_gpu:
            share["num_gpus"] = 1.0 / self.max_colocate_count
        return share

    def actor_threads(self) -> int:
        """torch intra-op (OpenMP) threads of one actor: its whole CPUs (:meth:`actor_resources`),
        at least 1. One thread per reserved CPU, so ranks that share a node do not oversubscribe
        its cores (on CPU a phase of ``n`` processes x ``t`` threads wants ``n * t`` cores)."""
        return max(1, int(self.num_cpus_per_process / self.max_colocate_count))

    def placement_groups(self) -> list[PlacementGroup]:
        """The placement groups, one per node (created and awaited on first use).

        Raises:
            RuntimeError: Ray is not initialised, or the cluster did not grant the bundles
                within ``ready_timeout_s`` (what was requested and what the cluster has).
        """
        if self._pgs is not None:
            return self._pgs
        if not ray.is_initialized():
            raise RuntimeError("ResourcePool needs a running Ray: call ray.init(...) first")
        pgs = [placement_group([self.bundle() for _ in range(count)], strategy="STRICT_PACK",
                               name=f"{self.name_prefix}_node{node}")
               for node, count in enumerate(self.process_on_nodes)]
        ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.ready_timeout_s)
        if len(ready) < len(pgs):
            for pg in pgs:
                remove_placement_group(pg)
            raise RuntimeError(
                f"resource pool {self.name_prefix!r}: the cluster did not grant {list(self.process_on_nodes)} "
                f"ranks per node with bundles {self.bundle()} within {self.ready_timeout_s:.0f}s; cluster "
                f"resources: {ray.cluster_resources()}, available: {ray.available_resources()}")
        self._pgs = pgs
        return pgs

    def bundle_of(self, rank: int) -> tuple[PlacementGroup, int]:
        """The placement group and bundle index of global ``rank``."""
        node, local = self.rank_layout()[rank]
        return self.placement_groups()[node], local

    def attach_group(self) -> None:
        """Count one more worker group on this pool.

        Raises:
            RuntimeError: the pool already hosts ``max_colocate_count`` groups.
        """
        if self._num_groups >= self.max_colocate_count:
            raise RuntimeError(f"resource pool {self.name_prefix!r} already hosts {self._num_groups} worker "
                               f"group(s) (max_colocate_count={self.max_colocate_count}); raise "
                               f"max_colocate_count or colocate the roles in one group")
        self._num_groups += 1

    def detach_group(self) -> None:
        """Count one worker group less (called by ``RayWorkerGroup.shutdown``)."""
        self._num_groups = max(0, self._num_groups - 1)

    def remove(self) -> None:
        """Release the placement groups (the groups' actors must be shut down first)."""
        for pg in self._pgs or []:
            remove_placement_group(pg)
        self._pgs, self._num_groups = None, 0

    def __repr__(self) -> str:
        return (f"ResourcePool({self.name_prefix!r}, process_on_nodes={list(self.process_on_nodes)}, "
                f"max_colocate_count={self.max_colocate_count}, use_gpu={self.use_gpu}, "
                f"num_cpus_per_process={self.num_cpus_per_process})")


__all__ = ["ResourcePool"]
