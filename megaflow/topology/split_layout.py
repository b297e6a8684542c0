"""Split placement's weight routes, without processes: who broadcasts to whom, how many bytes.

With ``resources.placement.rollout`` naming a pool of its own, the engines run as replicas
of TP = t_g on consecutive ranks of that pool; the actor keeps its generation layout
(:mod:`megaflow.topology.hybrid_layout`). For every generation TP rank ``j`` the actor rank of
generation replica 0 holding shard ``j`` broadcasts it to every rollout rank of TP rank
``j`` (:func:`plan_split_transport`). The dry-run planner and the weight transport
(:mod:`megaflow.hybrid_engine.transport`) read the same plan.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TransportGroup:
    """One broadcast group of split placement.

    Attributes:
        gen_tp_rank: the generation TP rank whose shard the group carries.
        source: the actor rank that sends (generation replica 0, TP rank ``gen_tp_rank``).
        receivers: the rollout ranks of TP rank ``gen_tp_rank`` (one per rollout replica).
    """

    gen_tp_rank: int
    source: int
    receivers: tuple[int, ...]

    def rank_of_rollout(self, rollout_rank: int) -> int | None:
        """``rollout_rank``'s rank in this group (the source is rank 0), None if not a member."""
        return 1 + self.receivers.index(rollout_rank) if rollout_rank in self.receivers else None


@dataclass(frozen=True)
class TransportPlan:
    """Every broadcast group of a split placement (:func:`plan_split_transport`)."""

    groups: tuple[TransportGroup, ...] = field(default_factory=tuple)

    def group_of_actor(self, actor_rank: int) -> TransportGroup | None:
        """The group ``actor_rank`` is the source of (None: it sends nothing)."""
        return next((g for g in self.groups if g.source == actor_rank), None)

    def group_of_rollout(self, rollout_rank: int) -> TransportGroup:
        """The group that feeds ``rollout_rank`` (StopIteration: not a rollout rank of the plan)."""
        return next(g for g in self.groups if rollout_rank in g.receivers)


def plan_split_transport(actor_layout, rollout_world_size: int) -> TransportPlan:
    """The broadcast groups from an actor's generation layout to a rollout pool.

    Args:
        actor_layout: the actor's :class:`~megaflow.topology.hybrid_layout.HybridLayout`
            (its ``gen_tp`` is the engines' TP size t_g).
        rollout_world_size: ranks of the rollout pool (a multiple of t_g); rollout rank
            ``r`` is TP rank ``r % t_g`` of replica ``r // t_g`` (vLLM's consecutive groups).

    Returns:
        One :class:`TransportGroup` per generation TP rank.

    Raises:
        ValueError: ``rollout_world_size`` not a positive multiple of t_g.
    """
    gen_tp = actor_layout.gen_tp
    if rollout_world_size < gen_tp or rollout_world_size % gen_tp:
        raise ValueError(f"rollout pool of {rollout_world_size} ranks is not a positive multiple of t_g={gen_tp}")
    groups = []
    for j in range(gen_tp):
        source = min(pl.rank for pl in actor_layout.ranks if pl.gen_dp_rank == 0 and pl.gen_tp_rank == j)
        receivers = tuple(r for r in range(rollout_world_size) if r % gen_tp == j)
        groups.append(TransportGroup(gen_tp_rank=j, source=source, receivers=receivers))
    return TransportPlan(tuple(groups))


def split_sync_bytes(model_bytes: int, gen_tp: int, rollout_world_size: int) -> tuple[int, int]:
    """Bytes one split-placement sync moves: ``(per rollout rank, in total)``.

    Every rollout rank receives its generation shard, ``model_bytes / t_g`` (the
    vocabulary's padding and the replicated norms aside), so the total is
    ``rollout_world_size * model_bytes / t_g``.
    """
    per_rank = model_bytes // gen_tp
    return per_rank, per_rank * rollout_world_size


__all__ = ["TransportGroup", "TransportPlan", "plan_split_transport", "split_sync_bytes"]
