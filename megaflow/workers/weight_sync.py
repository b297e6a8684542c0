"""The actor's weight sync: one loop for both layouts, and what a rank answers to a sync.

:class:`ActorWeightSync` is held by both actor workers, the colocated one
(:class:`~megaflow.workers.actor_rollout.ActorRolloutWorker`: the engine in its process, a
:class:`~megaflow.hybrid_engine.transport.ColocatedTransport`) and the one of split placement
(:class:`~megaflow.workers.rollout_worker.SplitActorWorker`: a
:class:`~megaflow.hybrid_engine.transport.BroadcastTransport` to the rollout group on the
source ranks, no transport elsewhere). It counts the actor's versions (updates and
checkpoint loads), reshards the actor's training shard into the generation layout
(:class:`~megaflow.hybrid_engine.reshard.MicroDPResharder`), converts it into vLLM buckets and
sends them through the rank's transport. :class:`WeightSync` is what one rank reports:
versions as integers, the sync's figures apart.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megaflow.config.schema import Config
    from megaflow.hybrid_engine.reshard import MicroDPResharder, ReshardStats
    from megaflow.hybrid_engine.transport import TransportStats, WeightTransport
    from megaflow.models.hf_mapping import ModelSpec
    from megaflow.rollout.lora_sync import AdapterSync
    from megaflow.rollout.vllm_rollout import VLLMRollout
    from megaflow.topology.hybrid_layout import HybridLayout
    from megaflow.workers.megatron_role import MegatronRole


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


def adapter_route(cfg: Config) -> bool:
    """``actor.lora.sync == "adapter"`` with adapters on: the engine serves base + LoRA adapter."""
    lora = cfg.actor.lora
    return lora.rank > 0 and lora.sync == "adapter"


class ActorWeightSync:
    """train -> generate -> train for one actor rank: the actor's versions and the one sync loop.

    Built with :meth:`build` (collective); the worker then gives it its engine
    (:meth:`use_engine`, colocated) or its transport (:meth:`use_transport`, split placement).

    Args:
        role: the actor's :class:`~megaflow.workers.megatron_role.MegatronRole`.
        resharder: the rank's :class:`~megaflow.hybrid_engine.reshard.MicroDPResharder`.
        spec: the served model's :class:`~megaflow.models.hf_mapping.ModelSpec`.
        gen_tp_rank: this rank's generation TP rank (the shard it converts).
        adapter_route: ``actor.lora.sync == "adapter"`` (:func:`adapter_route`).

    Attributes:
        actor_version: updates and checkpoint loads of the actor so far (:meth:`actor_changed`).
        synced_version: the actor version the last sync sent (-1: none yet).
        num_sends: syncs this rank has run that sent weights or an adapter.
    """

    layout: HybridLayout  # set by build

    def __init__(self, role: MegatronRole, resharder: MicroDPResharder, spec: ModelSpec, *, gen_tp_rank: int,
                 adapter_route: bool) -> None:
        self.role, self.resharder, self.spec = role, resharder, spec
        self.gen_tp_rank, self.adapter_route = gen_tp_rank, adapter_route
        self.engine: VLLMRollout | None = None  # colocated: the engine in this process
        self.transport: WeightTransport | None = None
        self.vllm_shapes: dict[str, tuple[int, ...]] | None = None  # the engine shard's vLLM name -> shape
        self.adapter_sync: AdapterSync | None = None  # the adapter route, on engine ranks
        self.actor_version, self.synced_version, self.num_sends = 0, -1, 0
        self.base_synced = False  # the engine holds the actor's frozen base (the adapter route)
        self.last_reshard_stats: ReshardStats | None = None
        self.last_transport_stats: TransportStats | None = None
        self.adapter_seconds: float | None = None  # the last adapter-only sync's duration

    @classmethod
    def build(cls, role: MegatronRole, rank: int) -> ActorWeightSync:
        """Plan the hybrid layout of the actor's mesh and ``rollout.tp``, build the reshard
        groups and the resharder over the actor's model (collective: every actor rank).

        With LoRA the merged sync sends ``W + (alpha / r) B A``, merged shard by shard; the
        adapter route sends the frozen base ``W`` (once) and the adapters apart.
        """
        from megaflow.hybrid_engine import MicroDPResharder, build_reshard_groups, plan_hybrid_layout
        from megaflow.megatron.lora import weight_sync_sources
        from megaflow.models.hf_mapping import ModelSpec

        cfg, info = role.config, role.info
        spec = ModelSpec.from_hf_config(role.spec.hf_config())
        layout = plan_hybrid_layout(info.tp_size, info.pp_size, info.dp_size, cfg.rollout.tp, cfg.rollout.pp,
                                    num_attention_heads=spec.num_heads, num_query_groups=spec.num_kv_heads,
                                    ep=info.ep_size)
        base, merged = weight_sync_sources(role.engine.module)
        route = adapter_route(cfg)
        resharder = MicroDPResharder(build_reshard_groups(layout), base, merged={} if route else merged,
                                     share_embeddings_and_output_weights=spec.tie_word_embeddings)
        sync = cls(role, resharder, spec, gen_tp_rank=layout.ranks[rank].gen_tp_rank, adapter_route=route)
        sync.layout = layout
        return sync

    def use_engine(self, engine: VLLMRollout) -> None:
        """Colocated: sync into ``engine`` in this process; on the adapter route publish adapters
        in it too (rollouts always from the newest policy, staleness 0; the engine was built
        with 2 adapter slots, :func:`~megaflow.workers.rollout_host.adapter_engine_settings`)."""
        from megaflow.hybrid_engine.transport import ColocatedTransport

        self.engine, self.transport = engine, ColocatedTransport(engine)
        self.vllm_shapes = engine.sharded_param_shapes()
        if self.adapter_route:
            from megaflow.rollout.lora_sync import AdapterSync

            self.adapter_sync = AdapterSync(engine, self.spec, alpha=self.role.config.actor.lora.alpha,
                                            staleness=0, base_model=engine.config.model_path)

    def use_transport(self, transport: WeightTransport | None, vllm_shapes: dict[str, tuple[int, ...]]) -> None:
        """Split placement: send through ``transport`` (None off the source ranks) shards of
        ``vllm_shapes`` (this rank's generation TP rank's)."""
        self.transport, self.vllm_shapes = transport, vllm_shapes

    def close(self) -> None:
        """Release what the sync holds outside this process's memory: on the adapter route the
        adapters' run directory (:meth:`~megaflow.rollout.lora_sync.AdapterSync.close`). Idempotent;
        the worker's ``close`` calls it at shutdown."""
        if self.adapter_sync is not None:
            self.adapter_sync.close()

    def actor_changed(self) -> None:
        """The actor's weights changed (an update, a checkpoint load): the next sync sends them."""
        self.actor_version += 1

    @property
    def current(self) -> bool:
        """The last sync sent the actor's current version."""
        return self.synced_version == self.actor_version

    # ------------------------------------------------------------------ the loop
    def report(self, bucket_mb: int, verify: Callable[[], float] | None = None) -> WeightSync:
        """Sync (:meth:`sync`) and report it as this rank's :class:`WeightSync`.

        Args:
            bucket_mb: the most MiB of converted tensors sent at once.
            verify: None, or a callable run after the sync that returns the largest
                engine-vs-actor log-prob difference (``rollout/verify_sync_max_diff``).

        Raises:
            ValueError: ``bucket_mb <= 0``.
        """
        if bucket_mb <= 0:
            raise ValueError(f"rollout.weight_sync_bucket_mb must be > 0, got {bucket_mb}")
        stale = not self.current  # the engines serve an older actor version
        self.sync(int(bucket_mb) << 20)
        figures = self.figures() if stale else {}
        if verify is not None:
            figures["rollout/verify_sync_max_diff"] = verify()
        weight_version = self.num_sends if self.engine is None else self.engine.weight_version
        return WeightSync(weight_version, self.synced_version, self.actor_version, figures)

    def sync(self, bucket_bytes: int) -> None:
        """Stream the actor's current weights through this rank's transport (collective).

        The generation shard is produced by the resharder, converted to vLLM's names and
        local layout and cut into buckets of at most ``bucket_bytes``
        (:func:`~megaflow.hybrid_engine.rollout_weights.generation_buckets`); at most one
        bucket is alive at a time. The transport moves them: into the engine in this process,
        or, under split placement, to the rollout group (a rank that is no source has no
        transport but still runs the conversion's collectives). Unchanged weights send only
        that news. Also runs when the engine discarded its weights (``rollout.sleep_level`` 2)
        with the actor unchanged.

        On the adapter route the first sync (and one after the engine lost its weights) sends
        the frozen base, every sync then publishes the LoRA adapters alone (:meth:`_sync_adapter`).
        """
        engine_valid = self.engine is None or self.engine.weights_valid  # level-2 sleep discards them
        if self.current and engine_valid:
            if self.transport is not None:
                self.transport.send_unchanged(self.actor_version)
            return
        if not self.adapter_route or not self.base_synced or not engine_valid:
            self._send_weights(bucket_bytes)
            self.base_synced = True
        else:  # adapter route, base in place: only the adapter moves
            self.last_reshard_stats = self.last_transport_stats = None
        if self.adapter_route:
            self._sync_adapter()
        self.synced_version = self.actor_version
        self.num_sends += 1

    def _send_weights(self, bucket_bytes: int) -> None:
        """Reshard the actor's weights (merged, or the frozen base on the adapter route) into the
        generation layout and send them through this rank's transport (collective), in a
        parameters-only phase of the actor's model."""
        from megaflow.hybrid_engine.rollout_weights import generation_buckets

        if self.vllm_shapes is None:
            raise RuntimeError("weight sync before the engine's shard shapes are known (init_model, or under "
                               "split placement init_weight_transport)")
        # streamed: the colocated transport's load_buckets wakes the engine's weights before it pulls the
        # first bucket, and each tensor is gathered only when its bucket is built (peak: actor + engine +
        # one bucket + one tensor; megaflow.topology.weight_sync); after the phase the training state goes
        # back off the device while the engine generates
        with self.role.phase(("params",)):
            buckets = generation_buckets(self.resharder, self.spec, gen_tp_rank=self.gen_tp_rank,
                                         vllm_shapes=self.vllm_shapes, bucket_bytes=bucket_bytes)
            # a failure aborts the update: the engine refuses to generate until a complete sync
            if self.transport is not None:
                self.last_transport_stats = self.transport.send(buckets, self.actor_version)
            else:
                for _ in buckets:  # the conversion's collectives (vocabulary exchanges) run on every rank
                    pass
        self.last_reshard_stats = self.resharder.last_stats

    def _sync_adapter(self) -> None:
        """Adapter route: gather the actor's LoRA adapters over TP and PP (collective on every
        rank) and publish them in the engine as the actor's version
        (:meth:`~megaflow.rollout.lora_sync.AdapterSync.sync`, which generation uses from now on)."""
        from megaflow.models.transforms import kv_replication_factor
        from megaflow.rollout.lora_sync import gather_adapter_pieces, local_adapter_tensors

        start = time.perf_counter()
        info = self.role.info
        pieces = gather_adapter_pieces(local_adapter_tensors(self.role.engine.module), tp_group=info.tp_group,
                                       pp_group=info.pp_group)
        if self.adapter_sync is not None:
            replication = kv_replication_factor(self.spec.num_kv_heads, self.spec.num_heads, info.tp_size)
            self.adapter_sync.sync(pieces, self.actor_version, kv_replication=replication)
        self.adapter_seconds = time.perf_counter() - start

    def figures(self) -> dict[str, float]:
        """What the last sync that moved weights moved: the reshard's figures, and the
        engine's bucket counts (colocated) or the transport's figures (a split source rank)."""
        s, t = self.last_reshard_stats, self.last_transport_stats
        figures = {} if self.adapter_seconds is None else {"timing_s/adapter_sync": self.adapter_seconds}
        if s is None:  # no sync has moved base weights yet, or an adapter-only sync
            return figures
        figures |= {"timing_s/reshard": s.seconds, "reshard/bytes_received": float(s.bytes_received),
                    "reshard/bytes_sent": float(s.bytes_sent)}
        if self.engine is not None and t is not None:
            figures.update({"rollout/weight_sync_buckets": float(t.num_buckets),
                            "rollout/weight_sync_bucket_bytes": float(t.largest_bucket)})
        elif t is not None:
            figures.update(t.as_metrics())
        return figures


__all__ = ["WeightSync", "ActorWeightSync", "adapter_route"]
