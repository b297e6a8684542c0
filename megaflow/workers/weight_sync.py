"""What one rank answers to a weight sync: versions as integers, the sync's figures apart."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class WeightSync:
    """One rank's state after a weight sync (the controller checks every rank's with
    :func:`~megaflow.workers.actor_rollout.check_synced` /
    :func:`~megaflow.workers.rollout_worker.check_split_synced`).

    Attributes:
        weight_version: weight syncs the rank's engine has received (an actor rank of split
            placement: syncs it has sent).
        synced_actor_version: the actor version (updates and checkpoint loads) the engine serves.
        actor_version: the actor's current version; None on a rollout rank (it only serves).
        figures: what the sync moved when weights changed (``timing_s/reshard``,
            ``reshard/*``, ``transport/*``, bucket counts; ``rollout/verify_sync_max_diff``
            with verification), as logged.
    """

    weight_version: int
    synced_actor_version: int
    actor_version: int | None = None
    figures: dict[str, float] = field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The sync's logged metrics: ``rollout/weight_version`` and :attr:`figures`."""
        return {"rollout/weight_version": float(self.weight_version), **self.figures}


__all__ = ["WeightSync"]
