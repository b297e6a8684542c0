"""What a run needs from its Ray cluster, and whether a cluster offers it.

:func:`launch_requirements` turns a loaded config into the per-node resources the run's
resource pools need: every enabled role runs on a pool (``resources.placement``), pools
are laid on the cluster's nodes by :func:`megaflow.topology.placement.pack_pools` (the same
placement the trainer and the dry run use), and every rank of a pool is one Ray bundle of
``resources.num_cpus_per_proc`` CPUs plus one GPU when ``resources.use_gpu``.

:func:`unmet` compares that requirement with the nodes a Ray cluster reports
(:class:`NodeResources`, from ``ray.nodes()``) and says, in words, what is missing. It is
pure, so the launch scripts and the tests share it; :mod:`megaflow.launch.cluster` polls
Ray with it.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from megaflow.config import Config


@dataclass(frozen=True)
class PoolRequirement:
    """One resource pool: ``len(nodes)`` nodes x ``procs_per_node`` ranks, each rank one
    bundle of ``cpus_per_proc`` CPUs and ``gpus_per_proc`` GPUs."""

    name: str
    roles: tuple[str, ...]
    """Enabled roles placed on the pool (colocated in one process per rank)."""
    nodes: tuple[int, ...]
    """Cluster node indices the pool occupies (pack_pools' first-fit order)."""
    procs_per_node: int
    cpus_per_proc: int
    gpus_per_proc: int

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def world_size(self) -> int:
        """Ranks of the pool."""
        return self.num_nodes * self.procs_per_node

    @property
    def total_cpus(self) -> int:
        return self.world_size * self.cpus_per_proc

    @property
    def total_gpus(self) -> int:
        return self.world_size * self.gpus_per_proc

    def describe(self) -> str:
        """``"pool 'global' (actor, ref): 8 nodes x 8 ranks, each rank 1 GPU + 8 CPUs"``."""
        rank = f"{self.gpus_per_proc} GPU + {self.cpus_per_proc} CPUs" if self.gpus_per_proc else \
            f"{self.cpus_per_proc} CPU{'s' if self.cpus_per_proc != 1 else ''}"
        return (f"pool {self.name!r} ({', '.join(self.roles)}): {_count(self.num_nodes, 'node')} x "
                f"{_count(self.procs_per_node, 'rank')}, each rank {rank}")


@dataclass(frozen=True)
class NodeRequirement:
    """What one node of the cluster must offer (the pools packed onto it)."""

    index: int
    cpus: int
    gpus: int
    pools: tuple[str, ...]


@dataclass(frozen=True)
class LaunchRequirements:
    """The whole cluster a launch needs: one :class:`NodeRequirement` per used node and one
    :class:`PoolRequirement` per used pool (the dry-run plan's one-line summary is
    :class:`megaflow.topology.sizes.ClusterRequirements`)."""

    experiment: str
    use_gpu: bool
    nodes: tuple[NodeRequirement, ...]
    pools: tuple[PoolRequirement, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def cpus_per_node(self) -> int:
        """CPUs of the most loaded node (every node when the pools are uniform)."""
        return max(n.cpus for n in self.nodes)

    @property
    def gpus_per_node(self) -> int:
        """GPUs of the most loaded node."""
        return max(n.gpus for n in self.nodes)

    @property
    def total_cpus(self) -> int:
        return sum(n.cpus for n in self.nodes)

    @property
    def total_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def uniform(self) -> bool:
        """Whether every node needs the same CPUs and GPUs."""
        return len({(n.cpus, n.gpus) for n in self.nodes}) == 1

    def describe(self) -> str:
        """One line, e.g. ``"8 nodes, each with 8 GPUs and 64 CPUs (64 GPUs, 512 CPUs in all)"``."""
        if self.uniform:
            head = f"{_count(self.num_nodes, 'node')}, each with {_offer(self.cpus_per_node, self.gpus_per_node)}"
        else:
            head = f"{_count(self.num_nodes, 'node')} ({'; '.join(_offer(n.cpus, n.gpus) for n in self.nodes)})"
        return f"{head} ({_offer(self.total_cpus, self.total_gpus)} in all)"

    def describe_pools(self) -> list[str]:
        """One line per pool (see :meth:`PoolRequirement.describe`)."""
        return [pool.describe() for pool in self.pools]


@dataclass(frozen=True)
class NodeResources:
    """One node of a Ray cluster as ``ray.nodes()`` reports it (total, not available)."""

    node_id: str
    ip: str
    hostname: str
    cpus: float
    gpus: float
    alive: bool

    @classmethod
    def from_ray(cls, entry: Mapping[str, Any]) -> NodeResources:
        """From one element of ``ray.nodes()``."""
        resources = entry.get("Resources") or {}
        return cls(node_id=str(entry.get("NodeID", "")), ip=str(entry.get("NodeManagerAddress", "")),
                   hostname=str(entry.get("NodeManagerHostname", "")), cpus=float(resources.get("CPU", 0.0)),
                   gpus=float(resources.get("GPU", 0.0)), alive=bool(entry.get("Alive", False)))

    def describe(self) -> str:
        """``"10.0.0.2 (gpu-02): 8 GPUs, 64 CPUs"``."""
        host = f" ({self.hostname})" if self.hostname and self.hostname != self.ip else ""
        return f"{self.ip}{host}: {_offer(self.cpus, self.gpus, sep=', ')}"


def launch_requirements(cfg: Config) -> LaunchRequirements:
    """The cluster that ``cfg``'s resource pools need.

    Only pools that host an enabled role (or the rollout under split placement) count;
    their node indices come from :func:`megaflow.topology.placement.pack_pools`, so a node
    shared by two small pools needs the sum of their ranks.

    Args:
        cfg: a validated :class:`megaflow.config.Config` (``load_run(...)``).

    Returns:
        The :class:`LaunchRequirements`; ``nodes`` are ordered by cluster node index.
    """
    from megaflow.topology.placement import pack_pools
    from megaflow.topology.sizes import pools_in_use

    res = cfg.resources
    gpus_per_proc = 1 if res.use_gpu else 0
    roles_of = pools_in_use(cfg)  # enabled roles, and the rollout's own pool under split placement
    pools = tuple(
        PoolRequirement(name=name, roles=roles_of[name], nodes=placement.nodes,
                        procs_per_node=placement.procs_per_node, cpus_per_proc=res.num_cpus_per_proc,
                        gpus_per_proc=gpus_per_proc)
        for name, placement in pack_pools(res).items() if name in roles_of)
    load: dict[int, list[PoolRequirement]] = {}
    for pool in pools:
        for node in pool.nodes:
            load.setdefault(node, []).append(pool)
    nodes = tuple(
        NodeRequirement(index=node, cpus=sum(p.procs_per_node * p.cpus_per_proc for p in on_node),
                        gpus=sum(p.procs_per_node * p.gpus_per_proc for p in on_node),
                        pools=tuple(p.name for p in on_node))
        for node, on_node in sorted(load.items()))
    return LaunchRequirements(experiment=cfg.trainer.experiment_name, use_gpu=bool(res.use_gpu), nodes=nodes,
                              pools=pools)


def unmet(required: LaunchRequirements, nodes: Sequence[NodeResources]) -> list[str]:
    """What the alive ``nodes`` lack to host ``required``; empty when they suffice.

    Each required node must be matched to a distinct alive node offering at least its CPUs
    and GPUs (Ray places a pool's ranks of one node with a ``STRICT_PACK`` placement
    group). Matching is greedy: the most demanding requirement first, each taking the
    smallest node that fits (exact for uniform requirements, the usual case).

    Returns:
        Human-readable shortfalls, e.g. ``["1 more node with 8 GPUs and 64 CPUs"]``.
    """
    free = sorted((n for n in nodes if n.alive), key=lambda n: (n.gpus, n.cpus))
    missing: list[NodeRequirement] = []
    for need in sorted(required.nodes, key=lambda n: (n.gpus, n.cpus), reverse=True):
        fit = next((n for n in free if n.gpus >= need.gpus and n.cpus >= need.cpus), None)
        if fit is None:
            missing.append(need)
        else:
            free.remove(fit)
    if not missing:
        return []
    groups: dict[tuple[int, int], int] = {}
    for need in missing:
        groups[(need.cpus, need.gpus)] = groups.get((need.cpus, need.gpus), 0) + 1
    problems = [f"{count} more {'node' if count == 1 else 'nodes'} with {_offer(cpus, gpus)}"
                for (cpus, gpus), count in groups.items()]
    if sum(n.alive for n in nodes) >= required.num_nodes:
        problems.append("enough nodes joined, but some offer fewer CPUs/GPUs than the pools place on them: "
                        "start Ray with more --num-cpus/--num-gpus per node, or lower resources.procs_per_node "
                        "/ resources.num_cpus_per_proc")
    return problems


def _count(n: float, noun: str) -> str:
    n = int(n) if float(n).is_integer() else n
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _offer(cpus: float, gpus: float, sep: str = " and ") -> str:
    parts = [_count(gpus, "GPU")] if gpus else []
    return sep.join(parts + [_count(cpus, "CPU")])


__all__ = ["PoolRequirement", "NodeRequirement", "LaunchRequirements", "NodeResources", "launch_requirements",
           "unmet"]
