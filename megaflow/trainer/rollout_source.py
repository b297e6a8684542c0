"""Where the step's rollouts come from: a :class:`RolloutSource` (colocated, split placement,
or one step off).

A source is built from the worker groups, the prompt loader and the config
(:func:`build_source`) and never sees the trainer. The controller's step
(:meth:`RayPPOTrainer.train_step`) asks it to bring the engines to the actor's weights
(:meth:`RolloutSource.sync`, a :class:`SyncReport`) and for the step's batch
(:meth:`RolloutSource.next_batch`); a checkpoint stores :meth:`RolloutSource.loader_state`.
Generation outside the step (validation, ReMax's greedy baseline) is
:meth:`RolloutSource.generate`. The request and the join are pure functions
(:func:`~megaflow.trainer.stages.generation_request`, :func:`~megaflow.trainer.stages.join_rollout`).
Three sources:

* :class:`ColocatedSource` (default): the engines live in the actor's processes; the sync
  is the actor group's ``sync_rollout_weights``.
* :class:`SplitSource` (``resources.placement.rollout`` names another pool): a
  :class:`~megaflow.workers.rollout_worker.RolloutWorker` group generates; the sync is two
  calls in lockstep, the actor's broadcast and the rollout group's ``receive_weights``
  (:func:`sync_split_weights`), versions checked on both sides.
* :class:`OneStepOffSource` (``trainer.async_rollout``, split placement only): the
  generation of batch k+1 is started (non-blocking) with the weights of version k right
  after the sync of step k, and runs on the rollout pool
  while the actor trains on batch k (verl's one-step-off policy, AReaL/slime's
  asynchronous mode with staleness 1). Every response carries the actor version that
  generated it (``weight_version``); the staleness ``actor version - weight_version``
  is bounded by ``trainer.max_staleness`` and logged (``rollout/staleness/*``). Rollout
  correction defaults to token-level TIS in this mode. ``timeline/*`` metrics give each
  phase's start and end (seconds since the pipeline started) so the overlap shows.

Checkpoints (:meth:`OneStepOffSource.loader_state`): a checkpoint stores the prompt
loader's state from before the in-flight batch was drawn, so a resumed run draws that
batch again (and generates it with the checkpoint's weights): no prompt is lost or
repeated.
"""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from megaflow.protocol import DataProto
from megaflow.single_controller.futures import GroupFuture
from megaflow.trainer.stages import generation_request, join_rollout, sampling_params

if TYPE_CHECKING:
    from megaflow.config import Config
    from megaflow.config.schema import RolloutConfig, RolloutCorrectionConfig
    from megaflow.hybrid_engine.transport import TransportPlan
    from megaflow.topology.hybrid_layout import HybridLayout
    from megaflow.trainer.proxies import ActorProxy, RolloutProxy, WorkerGroups


def agent_input_keys(cfg: Config) -> tuple[str, ...]:
    """The prompts' non-tensor fields a generate call carries: the agent loop's inputs
    (:data:`~megaflow.agent.vllm_agent.AGENT_INPUT_KEYS`) with ``rollout.agent.enabled``, else none."""
    if not cfg.rollout.agent.enabled:
        return ()
    from megaflow.agent.vllm_agent import AGENT_INPUT_KEYS

    return AGENT_INPUT_KEYS


# ---------------------------------------------------------------------------- split placement
def connect_split(actor: ActorProxy, rollout: RolloutProxy, actor_layout: HybridLayout, *,
                  backend: str) -> TransportPlan:
    """Build the broadcast groups between an actor group and a rollout group (once).

    Args:
        actor: the :class:`~megaflow.workers.rollout_worker.SplitActorWorker` group.
        rollout: the :class:`~megaflow.workers.rollout_worker.RolloutWorker` group.
        actor_layout: the actor's :class:`~megaflow.topology.hybrid_layout.HybridLayout`.
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
    GroupFuture.get_together([actor.init_weight_transport_async(host, port, plan, shapes, backend),
                              rollout.init_weight_transport_async(host, port, plan, backend)])
    return plan


def _rollout_group(groups: WorkerGroups) -> RolloutProxy:
    """``groups.rollout``, the engines' own group under split placement.

    Raises:
        ValueError: the groups have no rollout group (the engines live in the actor's processes).
    """
    if groups.rollout is None:
        raise ValueError("split placement needs a rollout group of its own (resources.placement.rollout); "
                         "these worker groups have none")
    return groups.rollout


def sync_split_weights(groups: WorkerGroups, rollout_cfg: RolloutConfig, *, dtype: str) -> dict[str, float]:
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

    rollout = _rollout_group(groups)
    per_actor, per_rollout = GroupFuture.get_together([
        groups.actor.sync_rollout_weights_async(verify=False, bucket_mb=rollout_cfg.weight_sync_bucket_mb),
        rollout.receive_weights_async()])  # a failure on either side raises at once
    metrics = check_split_synced(per_actor, per_rollout)
    metrics["rollout/actor_version"] = float(per_actor[0].actor_version)
    if rollout_cfg.verify_sync:
        metrics["rollout/verify_sync_max_diff"] = verify_split_sync(groups.actor, rollout, dtype)
    return metrics


def verify_split_sync(actor: ActorProxy, rollout: RolloutProxy, dtype: str) -> float:
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
    trainer = actor.compute_log_prob(DataProto.from_dict({k: out.tensors[k] for k in keys},
                                                         meta_info={"temperature": 1.0}))
    mask = out.tensors["response_mask"].bool()
    delta = (out.tensors["rollout_log_probs"] - trainer.tensors["old_log_probs"].to(torch.float32)).abs()
    worst = float(delta[mask].max()) if mask.any() else 0.0
    tolerance = verify_sync_tolerance(dtype)
    if worst > tolerance:
        raise RuntimeError(f"rollout.verify_sync: after the weight sync the rollout group's log-probs of the probe "
                           f"differ from the actor's by up to {worst:.3g} (tolerance {tolerance:g} for {dtype})")
    return worst


# ---------------------------------------------------------------------------- sources
#: Sampling-seed distance between the dynamic-sampling rounds of one step (steps are 1 apart).
ROUND_SEED_STRIDE = 1_000_003


@dataclasses.dataclass(frozen=True)
class SyncReport:
    """What one weight sync left the engines serving.

    Attributes:
        actor_version: the actor version (updates and checkpoint loads so far) the engines
            now serve.
        metrics: the sync's metrics as logged (``rollout/weight_version``, reshard and
            transport figures; ``rollout/actor_version`` under split placement).
    """

    actor_version: int
    metrics: dict[str, float]


class RolloutSource(Protocol):
    """Where a step's rollouts come from (see the module docstring)."""

    def sync(self) -> SyncReport:
        """Bring every engine to the actor's current weights (versions checked on every rank).

        Raises:
            RuntimeError: versions disagree after the sync (ranks named), or ``rollout.verify_sync`` failed.
        """

    def next_batch(self, step: int) -> tuple[DataProto, dict[str, float]]:
        """The batch of training step ``step`` (``rollout.n`` sampled responses per prompt of
        the next prompt batch; ``B = n x prompts``) and the rollout's metrics."""

    def next_round(self, step: int, sampling_round: int) -> tuple[DataProto, dict[str, float]]:
        """A further dynamic-sampling round of step ``step`` (``algorithm.filter_groups``,
        synchronous sources only): like :meth:`next_batch` on the next prompt batch, with
        request seeds moved by ``sampling_round x`` :data:`ROUND_SEED_STRIDE`."""

    def generate(self, prompts: DataProto, n: int, *, greedy: bool, step: int) -> tuple[DataProto, dict[str, float]]:
        """One generate call outside the step's batch (validation, ReMax's greedy baseline)
        with the sampling seed of ``step``; the caller has synced."""

    def loader_state(self) -> dict[str, Any]:
        """The prompt loader's state a checkpoint stores (no prompt lost or repeated on resume)."""

    def load_loader_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`loader_state` (a resumed run)."""

    def correction(self) -> RolloutCorrectionConfig:
        """The ``algorithm.rollout_correction`` the actor's update applies."""

    def step_done(self) -> dict[str, float]:
        """Metrics added after the step's update (the one-step-off timeline)."""


class PromptStream:
    """The prompt loader as an endless stream: a new (reshuffled) epoch starts when it runs out.

    Args:
        loader: resumable loader: iterable of prompt DataProtos with ``state_dict()`` /
            ``load_state_dict()``.
    """

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._iter: Iterator[DataProto] | None = None

    def next(self) -> DataProto:
        """The next prompt batch."""
        if self._iter is None:
            self._iter = iter(self.loader)
        try:
            return next(self._iter)
        except StopIteration:
            self._iter = iter(self.loader)
            return next(self._iter)

    def state(self) -> dict[str, Any]:
        """The loader's ``state_dict()``."""
        return self.loader.state_dict()

    def restore(self, state: dict[str, Any]) -> None:
        """Restore the loader and start a fresh iterator from it."""
        self.loader.load_state_dict(state)
        self._iter = None


class ColocatedSource:
    """Synchronous rollouts on the engines in the actor's processes.

    Args:
        groups: the worker groups (``groups.actor`` holds the engines).
        loader: the prompt loader (:class:`PromptStream`).
        cfg: the run's config.
    """

    def __init__(self, groups: WorkerGroups, loader: Any, cfg: Config) -> None:
        self.groups, self.cfg = groups, cfg
        self.prompts = PromptStream(loader)
        self.origin = time.time()  # timeline/* metrics count seconds from here

    def sync(self) -> SyncReport:
        from megaflow.workers.actor_rollout import check_synced

        r = self.cfg.rollout
        per_rank = self.groups.actor.sync_rollout_weights(verify=r.verify_sync, bucket_mb=r.weight_sync_bucket_mb)
        metrics = check_synced(per_rank)  # every engine serves its actor rank's version
        return SyncReport(actor_version=per_rank[0].synced_actor_version, metrics=metrics)

    def _engines(self) -> ActorProxy | RolloutProxy:
        """The group whose ``generate_sequences`` runs the engines."""
        return self.groups.actor

    def _request(self, prompts: DataProto, n: int, *, greedy: bool, step: int) -> tuple[DataProto, DataProto]:
        sampling = sampling_params(self.cfg.rollout, run_seed=self.cfg.trainer.seed, step=step, greedy=greedy)
        return generation_request(prompts, n, sampling, agent_input_keys(self.cfg))

    def generate(self, prompts: DataProto, n: int, *, greedy: bool, step: int,
                 sampling_round: int = 0) -> tuple[DataProto, dict[str, float]]:
        prompts, gen_in = self._request(prompts, n, greedy=greedy, step=step)
        gen_in.meta_info["seed"] += sampling_round * ROUND_SEED_STRIDE
        batch, metrics = join_rollout(prompts, self._engines().generate_sequences(gen_in), n)
        return batch, self._relative_times(metrics)

    def next_batch(self, step: int) -> tuple[DataProto, dict[str, float]]:
        return self.generate(self.prompts.next(), self.cfg.rollout.n, greedy=False, step=step)

    def next_round(self, step: int, sampling_round: int) -> tuple[DataProto, dict[str, float]]:
        return self.generate(self.prompts.next(), self.cfg.rollout.n, greedy=False, step=step,
                             sampling_round=sampling_round)

    def _relative_times(self, metrics: dict[str, float]) -> dict[str, float]:
        """``timeline/*_unix`` worker wall-clock times -> seconds since this source started."""
        for key in [k for k in metrics if k.startswith("timeline/") and k.endswith("_unix")]:
            metrics[key.removesuffix("_unix")] = metrics.pop(key) - self.origin
        return metrics

    def loader_state(self) -> dict[str, Any]:
        return self.prompts.state()

    def load_loader_state(self, state: dict[str, Any]) -> None:
        self.prompts.restore(state)

    def correction(self) -> RolloutCorrectionConfig:
        return self.cfg.algorithm.rollout_correction

    def step_done(self) -> dict[str, float]:
        return {}


class SplitSource(ColocatedSource):
    """Synchronous rollouts on a rollout group of its own (split placement)."""

    def sync(self) -> SyncReport:
        metrics = sync_split_weights(self.groups, self.cfg.rollout, dtype=self.cfg.model.dtype)
        return SyncReport(actor_version=int(metrics["rollout/actor_version"]), metrics=metrics)

    def _engines(self) -> ActorProxy | RolloutProxy:
        return _rollout_group(self.groups)


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


class OneStepOffSource(SplitSource):
    """Generation of batch k+1 (weights of version k) overlaps training on batch k.

    Needs split placement (``groups.rollout``); see the module docstring. The rollout group
    runs its calls in order: the generation of batch k (started during step k-1) finishes
    before step k's sync reaches the engines, so it keeps the older weights.
    """

    def __init__(self, groups: WorkerGroups, loader: Any, cfg: Config) -> None:
        super().__init__(groups, loader, cfg)
        self.max_staleness = int(cfg.trainer.max_staleness)
        self.queue: deque[_InFlight] = deque()
        self.actor_version: int | None = None
        self._timeline: dict[str, float] = {}

    def sync(self) -> SyncReport:
        start = time.time()
        report = super().sync()
        self.actor_version = report.actor_version
        self._timeline = {"timeline/sync_start": start - self.origin, "timeline/sync_end": time.time() - self.origin}
        return report

    def _draw(self, step: int) -> _InFlight:
        state = self.prompts.state()
        return _InFlight(prompts=self.prompts.next(), loader_state=state, step=step)

    def _start(self, item: _InFlight) -> None:
        item.prompts, gen_in = self._request(item.prompts, self.cfg.rollout.n, greedy=False, step=item.step)
        item.future = _rollout_group(self.groups).generate_sequences_async(gen_in)

    def next_batch(self, step: int) -> tuple[DataProto, dict[str, float]]:
        """The batch of ``step`` (generated with the previous sync's weights, or, on the first
        step and the first after a resume, with this step's), after starting the generation of
        the batch of ``step + 1`` with the weights of this step's sync.

        Raises:
            RuntimeError: called before the first :meth:`sync` (no actor version to bound the staleness by).
        """
        if self.actor_version is None:
            raise RuntimeError("OneStepOffSource.next_batch before the first sync: no actor version to bound staleness")
        if not self.queue:  # the first step (or the first after a resume): nothing in flight yet
            self.queue.append(self._draw(step))
        head = self.queue[0]
        if head.future is None:
            self._start(head)
        nxt = self._draw(step + 1)
        self._start(nxt)
        self.queue.append(nxt)
        self.queue.popleft()
        batch, metrics = join_rollout(head.prompts, head.future.get(), self.cfg.rollout.n)
        metrics = self._relative_times(metrics)
        self._timeline["timeline/train_start"] = time.time() - self.origin
        metrics.update(staleness_metrics(batch.tensors["weight_version"], self.actor_version, self.max_staleness))
        return batch, metrics

    def correction(self) -> RolloutCorrectionConfig:
        """Token-level TIS (``is_level="token"``) unless ``algorithm.rollout_correction``
        chooses weights, rejection or bypass itself."""
        rc = self.cfg.algorithm.rollout_correction
        if rc.active or rc.bypass:
            return rc
        return dataclasses.replace(rc, is_level="token")

    def loader_state(self) -> dict[str, Any]:
        """The loader's state before the oldest batch not yet trained on was drawn."""
        return self.queue[0].loader_state if self.queue else self.prompts.state()

    def load_loader_state(self, state: dict[str, Any]) -> None:
        super().load_loader_state(state)
        self.queue.clear()

    def step_done(self) -> dict[str, float]:
        timeline, self._timeline = self._timeline, {}
        timeline["timeline/train_end"] = time.time() - self.origin
        return timeline


def build_source(groups: WorkerGroups, loader: Iterable[DataProto], cfg: Config) -> RolloutSource:
    """The source ``cfg`` asks for: one step off (``trainer.async_rollout``), split
    (``groups.rollout`` set: ``resources.placement.rollout`` names another pool) or colocated."""
    if cfg.trainer.async_rollout:
        return OneStepOffSource(groups, loader, cfg)
    return ColocatedSource(groups, loader, cfg) if groups.rollout is None else SplitSource(groups, loader, cfg)


__all__ = ["RolloutSource", "SyncReport", "ColocatedSource", "SplitSource", "OneStepOffSource", "PromptStream",
           "build_source", "connect_split", "sync_split_weights", "verify_split_sync", "staleness_metrics"]
