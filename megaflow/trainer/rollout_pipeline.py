"""Where the step's rollouts come from: colocated, split placement, or one step off.

The controller's step (:meth:`RayPPOTrainer.train_step`) asks a rollout pipeline for
three things: sync the actor's weights into the engines (``sync``), generate the step's
batch (``generate``), and, for generation outside the step (validation, ReMax's greedy
baseline), one generate call (``generate_sequences``). Three pipelines:

* :class:`RolloutPipeline` with the colocated layout (default): the engines live in the
  actor's processes; the sync is the actor group's ``sync_rollout_weights``.
* :class:`RolloutPipeline` with split placement (``resources.placement.rollout`` names
  another pool): a :class:`~megaflow.workers.rollout_worker.RolloutWorker` group
  generates; the sync is two calls in lockstep, the actor's broadcast and the rollout
  group's ``receive_weights`` (:func:`sync_split_weights`), versions checked on both sides.
* :class:`OneStepOffPipeline` (``trainer.async_rollout``, split placement only): the
  generation of batch k+1 is started (non-blocking, :meth:`RayWorkerGroup.submit`) with
  the weights of version k right after the sync of step k, and runs on the rollout pool
  while the actor trains on batch k (verl's one-step-off policy, AReaL/slime's
  asynchronous mode with staleness 1). Every response carries the actor version that
  generated it (``weight_version``); the staleness ``actor version - weight_version``
  is bounded by ``trainer.max_staleness`` and logged (``rollout/staleness/*``). Rollout
  correction defaults to token-level TIS in this mode. ``timeline/*`` metrics give each
  phase's start and end (seconds since the pipeline started) so the overlap shows.

Checkpoints (:meth:`OneStepOffPipeline.loader_state`): a checkpoint stores the prompt
loader's state from before the in-flight batch was drawn, so a resumed run draws that
batch again (and generates it with the checkpoint's weights): no prompt is lost or
repeated.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

import torch

from megaflow.protocol import DataProto
from megaflow.single_controller.collect import GroupProtoResult
from megaflow.single_controller.futures import GroupFuture


# ---------------------------------------------------------------------------- split placement
def connect_split(actor, rollout, actor_layout, *, backend: str):
    """Build the broadcast groups between an actor group and a rollout group (once).

    Args:
        actor: the :class:`~megaflow.workers.rollout_worker.SplitActorWorker` group.
        rollout: the :class:`~megaflow.workers.rollout_worker.RolloutWorker` group.
        actor_layout: the actor's :class:`~megaflow.config.hybrid_layout.HybridLayout`.
        backend: ``"gloo"`` or ``"nccl"``.

    Returns:
        The :class:`~megaflow.hybrid_engine.transport.TransportPlan`.

    Raises:
        WorkerError: a rank failed to join.
    """
    from megaflow.hybrid_engine.transport import plan_split_transport

    plan = plan_split_transport(actor_layout, rollout.world_size)
    per_rank = rollout.sharded_param_shapes()
    shapes = [per_rank[g.receivers[0]] for g in plan.groups]
    host, port = actor.open_weight_store()
    GroupFuture.get_together([actor.submit("init_weight_transport", host, port, plan, shapes, backend),
                              rollout.submit("init_weight_transport", host, port, plan, backend)])
    return plan


def sync_split_weights(groups, rollout_cfg, *, dtype: str) -> dict[str, float]:
    """One split-placement sync: the actor broadcasts (in buckets of
    ``rollout.weight_sync_bucket_mb``), the rollout group receives, both in lockstep; with
    ``rollout.verify_sync`` the probe check follows (:func:`verify_split_sync`).

    Returns:
        :func:`~megaflow.workers.rollout_worker.check_split_synced`'s metrics plus
        ``rollout/actor_version`` (the actor version the engines now serve).

    Raises:
        RuntimeError: versions disagree after the sync (ranks named), or the probe check failed.
        WorkerError: a rank failed.
    """
    from megaflow.workers.rollout_worker import check_split_synced

    per_actor, per_rollout = GroupFuture.get_together([
        groups.actor.submit("sync_rollout_weights", verify=False, bucket_mb=rollout_cfg.weight_sync_bucket_mb),
        groups.rollout.submit("receive_weights")])  # a failure on either side raises at once
    metrics = check_split_synced(per_actor, per_rollout)
    metrics["rollout/actor_version"] = per_actor[0]["rollout/actor_version"]
    if rollout_cfg.verify_sync:
        metrics["rollout/verify_sync_max_diff"] = verify_split_sync(groups.actor, groups.rollout, dtype)
    return metrics


def verify_split_sync(actor, rollout, dtype: str) -> float:
    """``rollout.verify_sync`` for split placement: the engines' log-probs of a fixed greedy
    probe against the actor's recomputation (tolerance by ``model.dtype``:
    :func:`~megaflow.rollout.verify_sync.verify_sync_tolerance`).

    Returns:
        The largest |engine - trainer| log-prob difference over the probe's response tokens.

    Raises:
        RuntimeError: a difference above the tolerance, naming it.
    """
    from megaflow.rollout.verify_sync import verify_sync_tolerance

    out = rollout.probe_rollout()[0]
    keys = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")
    trainer = actor.compute_log_prob(DataProto.from_dict({k: out.batch[k] for k in keys},
                                                         meta_info={"temperature": 1.0}))
    mask = out.batch["response_mask"].bool()
    delta = (out.batch["rollout_log_probs"] - trainer.batch["old_log_probs"].to(torch.float32)).abs()
    worst = float(delta[mask].max()) if mask.any() else 0.0
    tolerance = verify_sync_tolerance(dtype)
    if worst > tolerance:
        raise RuntimeError(f"rollout.verify_sync: after the weight sync the rollout group's log-probs of the probe "
                           f"differ from the actor's by up to {worst:.3g} (tolerance {tolerance:g} for {dtype})")
    return worst


# ---------------------------------------------------------------------------- pipelines
class RolloutPipeline:
    """Synchronous rollouts (colocated, or split when ``groups.rollout`` is set)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.actor_version: int | None = None
        self.origin = time.time()  # timeline/* metrics count seconds from here

    def next_prompts(self, trainer) -> DataProto:
        """The prompts of the next step."""
        return trainer.next_prompts()

    def sync(self, trainer) -> dict[str, float]:
        """The step's sync: the engines serve the actor's current weights (versions checked,
        :meth:`RayPPOTrainer.sync_rollout_weights`)."""
        metrics = trainer.sync_rollout_weights()
        if "rollout/actor_version" in metrics:
            self.actor_version = int(metrics["rollout/actor_version"])
        return metrics

    def generate(self, trainer, prompts: DataProto) -> tuple[DataProto, dict[str, float]]:
        """The step's batch: ``rollout.n`` sampled responses per prompt."""
        batch, metrics = trainer._generate(prompts, self.cfg.rollout.n, greedy=False)
        return batch, self._relative_times(metrics)

    def _relative_times(self, metrics: dict[str, float]) -> dict[str, float]:
        """``timeline/*_unix`` worker wall-clock times -> seconds since this pipeline started."""
        for key in [k for k in metrics if k.startswith("timeline/") and k.endswith("_unix")]:
            metrics[key.removesuffix("_unix")] = metrics.pop(key) - self.origin
        return metrics

    def generate_sequences(self, trainer, gen_in: DataProto) -> GroupProtoResult:
        """One generate call on the engines' group (the actor's, or the rollout group's
        under split placement); the caller has synced. Returns the rows and each
        generation replica's metrics."""
        g = trainer.groups
        return (g.actor if g.rollout is None else g.rollout).generate_sequences(gen_in)

    def correction(self, cfg):
        """The ``algorithm.rollout_correction`` the actor's update applies."""
        return cfg.algorithm.rollout_correction

    def loader_state(self, trainer) -> dict[str, Any]:
        """The prompt loader's state a checkpoint stores."""
        return trainer.train_loader.state_dict()

    def step_done(self) -> dict[str, float]:
        """Metrics added after the step (none here)."""
        return {}


@dataclasses.dataclass
class _InFlight:
    """One batch on its way: its prompts, the loader's state from before they were drawn,
    the step they are for (its sampling seed) and the pending generation (None until started)."""

    prompts: DataProto
    loader_state: dict[str, Any]
    step: int
    future: Any = None


def staleness_metrics(weight_version: torch.Tensor, actor_version: int, max_staleness: int) -> dict[str, float]:
    """Per-sample staleness ``actor_version - weight_version`` of a batch, bounded.

    Args:
        weight_version: ``[B]`` int64, the actor version that generated each response.
        actor_version: the version of the actor that trains on the batch.
        max_staleness: the bound (``trainer.max_staleness``).

    Returns:
        ``rollout/staleness/mean``, ``/max``, ``/min`` (in actor versions).

    Raises:
        RuntimeError: a sample older than the bound (or from a future version), naming
            the key, the bound and the offending versions.
    """
    stale = actor_version - weight_version.to(torch.int64)
    if bool((stale > max_staleness).any()) or bool((stale < 0).any()):
        bad = sorted({int(v) for v in weight_version[(stale > max_staleness) | (stale < 0)].tolist()})
        raise RuntimeError(f"trainer.max_staleness={max_staleness}: samples generated with weight versions {bad} "
                           f"reached the actor at version {actor_version}")
    return {"rollout/staleness/mean": float(stale.float().mean()), "rollout/staleness/max": float(stale.max()),
            "rollout/staleness/min": float(stale.min())}


class OneStepOffPipeline(RolloutPipeline):
    """Generation of batch k+1 (weights of version k) overlaps training on batch k.

    Needs split placement (``groups.rollout``); see the module docstring.
    """

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.max_staleness = int(cfg.trainer.max_staleness)
        self.queue: deque[_InFlight] = deque()
        self._timeline: dict[str, float] = {}

    def _draw(self, trainer, step: int) -> _InFlight:
        state = trainer.train_loader.state_dict()
        return _InFlight(prompts=trainer.next_prompts(), loader_state=state, step=step)

    def _submit(self, trainer, item: _InFlight) -> None:
        item.prompts, gen_in = trainer._generation_request(item.prompts, self.cfg.rollout.n, greedy=False,
                                                           step=item.step)
        item.future = trainer.groups.rollout.submit("generate_sequences", gen_in)

    def next_prompts(self, trainer) -> DataProto:
        if not self.queue:  # the first step (or the first after a resume): nothing in flight yet
            self.queue.append(self._draw(trainer, trainer.global_step))
        return self.queue[0].prompts

    def sync(self, trainer) -> dict[str, float]:
        """Sync (after the head batch's generation, which the rollout group runs first),
        then start generating the next step's batch with the new weights."""
        start = time.time()
        head = self.queue[0]
        # The rollout group runs its calls in order: the head's generation (started last
        # step) finishes before this sync's receive, so it keeps the older weights.
        metrics = super().sync(trainer)
        if head.future is None:  # first step (or first after a resume): generate it with these weights
            self._submit(trainer, head)
        nxt = self._draw(trainer, trainer.global_step + 1)
        self._submit(trainer, nxt)
        self.queue.append(nxt)
        self._timeline = {"timeline/sync_start": start - self.origin, "timeline/sync_end": time.time() - self.origin}
        return metrics

    def generate(self, trainer, prompts: DataProto) -> tuple[DataProto, dict[str, float]]:
        head = self.queue.popleft()
        out = head.future.get()
        batch, metrics = trainer._join_rollout(head.prompts, out, self.cfg.rollout.n)
        metrics = self._relative_times(metrics)
        self._timeline["timeline/train_start"] = time.time() - self.origin
        metrics.update(staleness_metrics(batch.batch["weight_version"], self.actor_version, self.max_staleness))
        return batch, metrics

    def correction(self, cfg):
        """Token-level TIS (``is_level="token"``) unless ``algorithm.rollout_correction``
        chooses weights, rejection or bypass itself."""
        rc = cfg.algorithm.rollout_correction
        if rc.active or rc.bypass:
            return rc
        return dataclasses.replace(rc, is_level="token")

    def loader_state(self, trainer) -> dict[str, Any]:
        """The loader's state before the oldest batch not yet trained on was drawn."""
        return self.queue[0].loader_state if self.queue else trainer.train_loader.state_dict()

    def step_done(self) -> dict[str, float]:
        timeline, self._timeline = self._timeline, {}
        timeline["timeline/train_end"] = time.time() - self.origin
        return timeline


def build_pipeline(cfg) -> RolloutPipeline:
    """The pipeline ``cfg`` asks for (``trainer.async_rollout``: one step off)."""
    return OneStepOffPipeline(cfg) if cfg.trainer.async_rollout else RolloutPipeline(cfg)


__all__ = ["RolloutPipeline", "OneStepOffPipeline", "build_pipeline", "connect_split", "sync_split_weights",
           "verify_split_sync", "staleness_metrics"]
