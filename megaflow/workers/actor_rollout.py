"""The actor with its colocated rollout engine: the 3D-HybridEngine in one worker.

Each rank holds its Megatron training shard (layout p-t-d) and one vLLM engine shard of
the generation layout (p_g-t_g-d_g-d). ``sync_rollout_weights`` (a step of its own in
``RayPPOTrainer.train_step``) makes the engine serve the actor's current weights: when
the actor has changed since the last sync (an update, a checkpoint load, start-up), the
:class:`~megaflow.hybrid_engine.reshard.MicroDPResharder` all-gathers each parameter
inside its micro-DP group into the generation layout, the shard is converted to vLLM's
names and layouts (:mod:`megaflow.hybrid_engine.rollout_weights`) and pushed into the
engine, and the generation buffers are released again (train -> generate -> train). The
engine's weight version increments and its prefix cache is reset on every sync; the
controller checks with :func:`check_synced` that every rank serves the actor's version.
With ``actor.lora.sync == "adapter"`` the resharder moves the frozen base once and every
sync then publishes only the LoRA adapters (:class:`~megaflow.rollout.lora_sync.AdapterSync`).
The shard travels in buckets of ``rollout.weight_sync_bucket_mb`` MiB, produced lazily
from the resharder (at most one bucket alive). ``generate_sequences`` only generates: it
refuses to run on weights older than the actor's.

Dispatch: ``generate_sequences`` is registered on the ``rollout`` mesh
(``dp_rank`` = generation replica, collected from generation TP rank 0), the actor's
other methods on the ``actor`` mesh (Megatron DP rank, collected from tp 0 / last stage).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from megaflow.protocol import DataProto
from megaflow.rollout.verify_sync import verify_sync_tolerance
from megaflow.single_controller import Dispatch, ProtoResult, nd_compute, register
from megaflow.topology.role_spec import RoleSpec
from megaflow.workers.megatron_workers import ActorWorker
from megaflow.workers.rollout_host import RolloutHost, stop_token_ids
from megaflow.workers.weight_sync import WeightSync

if TYPE_CHECKING:
    from megaflow.hybrid_engine.reshard import MicroDPResharder, ReshardStats
    from megaflow.hybrid_engine.transport import TransportStats, WeightTransport
    from megaflow.rollout.lora_sync import AdapterSync
    from megaflow.rollout.vllm_rollout import VLLMRollout

#: Default of ``bucket_mb`` (``rollout.weight_sync_bucket_mb``): a 70B model's generation
#: shard at t_g = 8 (about 17 GB in bf16) streams in about 35 buckets, and its largest
#: tensor (the embedding shard, 128256 / 8 x 8192 x 2 bytes = 250 MiB) fits in one.
DEFAULT_WEIGHT_SYNC_BUCKET_MB = 512


class ActorRolloutWorker(ActorWorker):
    """:class:`ActorWorker` plus a vLLM engine fed by the micro-DP resharder.

    The engine reads ``rollout`` (``tp`` = t_g, ``response_length``, ``gpu_memory_utilization``,
    ``sleep_level``, ``enforce_eager``, the CPU KV cache keys, ``ignore_eos``), ``data.max_prompt_length``,
    ``model.dtype`` and
    ``trainer.seed`` from the config; ``rollout.pp > 1`` is refused at load.

    Args:
        spec: the actor's :class:`~megaflow.topology.role_spec.RoleSpec`.
        eos_token_ids: the tokenizer's end-of-sequence ids (stop ids unless ``rollout.ignore_eos``).
        pad_token_id: the tokenizer's padding id (right-padding of responses, left-padding of prompts).
    """

    resharder: MicroDPResharder  # set by init_model

    def __init__(self, spec: RoleSpec, eos_token_ids: tuple[int, ...], pad_token_id: int) -> None:
        super().__init__(spec)
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.host: RolloutHost | None = None
        self.rollout: VLLMRollout | None = None  # the host's engine
        self.transport: WeightTransport | None = None  # set with the engine (or the split transport)
        self._vllm_shapes: dict[str, tuple[int, ...]] | None = None  # the engine shard's vLLM name -> shape
        self._actor_version = 0
        self._synced_version = -1
        self._num_sends = 0
        self.last_reshard_stats: ReshardStats | None = None
        self.last_transport_stats: TransportStats | None = None
        self.adapter_sync: AdapterSync | None = None  # actor.lora.sync == "adapter", on engine ranks
        self._base_synced = False  # the engine holds the actor's frozen base (the adapter route)
        self._adapter_seconds: float | None = None  # the last adapter-only sync's duration

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the Megatron actor, the reshard groups and the vLLM engine (collective)."""
        from megaflow.hybrid_engine import MicroDPResharder, build_reshard_groups, plan_hybrid_layout
        from megaflow.megatron.lora import weight_sync_sources
        from megaflow.models.hf_mapping import ModelSpec

        super().init_model()
        rollout, info = self.config.rollout, self.info
        hf_config = self.role_spec.hf_config()
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.layout = plan_hybrid_layout(info.tp_size, info.pp_size, info.dp_size, rollout.tp, rollout.pp,
                                         num_attention_heads=self.spec.num_heads,
                                         num_query_groups=self.spec.num_kv_heads, ep=info.ep_size)
        self.reshard_groups = build_reshard_groups(self.layout)
        # LoRA, merged sync: the adapted weights go out as W + (alpha / r) B A, merged shard by shard;
        # adapter sync: the frozen base W goes out (once), the adapters separately (_sync_adapter)
        base, merged = weight_sync_sources(self.engine.module)
        if self._adapter_route:
            merged = {}
        self.resharder = MicroDPResharder(self.reshard_groups, base, merged=merged,
                                          share_embeddings_and_output_weights=self.spec.tie_word_embeddings)
        placement = self.layout.ranks[self.rank]
        self.register_dp_info("rollout", dp_rank=placement.gen_dp_rank, is_collect=placement.is_collect)
        self._gen_tp_rank = placement.gen_tp_rank
        self.host = self._build_host(hf_config, placement.gen_dp_rank)
        self.rollout = None if self.host is None else self.host.engine
        if self.rollout is not None:  # the engine in this process: the sync loads it in place
            from megaflow.hybrid_engine.transport import ColocatedTransport

            self.transport = ColocatedTransport(self.rollout)
            self._vllm_shapes = self.rollout.sharded_param_shapes()
            if self._adapter_route:
                from megaflow.rollout.lora_sync import AdapterSync

                # colocated: rollouts always come from the newest policy (staleness 0); the engine was
                # built with max_lora_versions = 2 (rollout_host.build_engine)
                self.adapter_sync = AdapterSync(self.rollout, self.spec, alpha=self.config.actor.lora.alpha,
                                                staleness=0, base_model=self.rollout.config.model_path)

    @property
    def _adapter_route(self) -> bool:
        """``actor.lora.sync == "adapter"`` with adapters on: the engine serves base + LoRA adapter."""
        lora = self.config.actor.lora
        return lora.rank > 0 and lora.sync == "adapter"

    def _build_host(self, hf_config: Any, gen_replica: int) -> RolloutHost | None:
        """This rank's engine shard (:class:`~megaflow.workers.rollout_host.RolloutHost`)."""
        return RolloutHost(self.config, hf_config, self.spec, rank=self.rank, tp_group_ranks=self.layout.gen_tp_groups,
                           gen_replica=gen_replica, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id)

    def _engine_host(self) -> RolloutHost:
        """This rank's engine host (the colocated actor always has one).

        Raises:
            RuntimeError: this rank has no engine (split placement's actor).
        """
        if self.host is None:
            raise RuntimeError(f"rank {self.rank} holds no rollout engine (split placement)")
        return self.host

    # ------------------------------------------------------------------ weight sync
    def _sync_rollout_weights(self, bucket_bytes: int) -> None:
        """train -> generate -> train: stream the actor's current weights through this rank's
        weight transport (the one sync loop of both layouts).

        The generation shard is produced by the resharder, converted to vLLM's names and
        local layout and cut into buckets of at most ``bucket_bytes``
        (:func:`~megaflow.hybrid_engine.rollout_weights.iter_vllm_buckets`); at most one
        bucket is alive at a time. The transport moves them: into the engine in this process
        (:class:`~megaflow.hybrid_engine.transport.ColocatedTransport`), or, under split
        placement, to the rollout group
        (:class:`~megaflow.hybrid_engine.transport.BroadcastTransport`; a rank that is no
        source has no transport but still runs the conversion's collectives). Unchanged
        weights send only that news. Parameters only are reloaded onto the device. Also runs
        when the engine discarded its weights (``rollout.sleep_level`` 2) with the actor unchanged.

        ``actor.lora.sync == "adapter"``: the first sync (and one after the engine lost its
        weights) sends the frozen base weights, every sync then publishes the LoRA adapters alone
        (:meth:`_sync_adapter`); the base is not resharded again.
        """
        engine_valid = self.rollout is None or self.rollout.weights_valid  # level-2 sleep discards them
        if self._synced_version == self._actor_version and engine_valid:
            if self.transport is not None:
                self.transport.send_unchanged(self._actor_version)
            return
        if not self._adapter_route or not self._base_synced or not engine_valid:
            self._send_weights(bucket_bytes)
            self._base_synced = True
        else:  # adapter route, base in place: only the adapter moves
            self.last_reshard_stats = self.last_transport_stats = None
        if self._adapter_route:
            self._sync_adapter()
        self._synced_version = self._actor_version
        self._num_sends += 1

    def _send_weights(self, bucket_bytes: int) -> None:
        """Reshard the actor's weights (merged, or the frozen base on the adapter route) into the
        generation layout and send them through this rank's transport (collective)."""
        from megaflow.hybrid_engine.rollout_weights import generation_buckets

        if self._vllm_shapes is None:
            raise RuntimeError("weight sync before the engine's shard shapes are known (init_model, or under "
                               "split placement init_weight_transport)")
        self._before_phase(("params",))  # the sync reads parameters only: grads/optimizer stay offloaded
        try:
            # streamed: the colocated transport's load_buckets wakes the engine's weights before it pulls
            # the first bucket, and each tensor is gathered only when its bucket is built (peak: actor +
            # engine + one bucket + one tensor; megaflow.topology.weight_sync)
            buckets = generation_buckets(self.resharder, self.spec, gen_tp_rank=self._gen_tp_rank,
                                         vllm_shapes=self._vllm_shapes, bucket_bytes=bucket_bytes)
            # a failure aborts the update: the engine refuses to generate until a complete sync
            if self.transport is not None:
                self.last_transport_stats = self.transport.send(buckets, self._actor_version)
            else:
                for _ in buckets:  # the conversion's collectives (vocabulary exchanges) run on every rank
                    pass
        finally:
            self._after_phase()  # the training state goes back off the device while the engine generates
        self.last_reshard_stats = self.resharder.last_stats

    def _sync_adapter(self) -> None:
        """Adapter route: gather the actor's LoRA adapters over TP and PP (collective on every
        rank) and publish them in the engine as the actor's version
        (:meth:`~megaflow.rollout.lora_sync.AdapterSync.sync`, which generation uses from now on)."""
        import time

        from megaflow.models.transforms import kv_replication_factor
        from megaflow.rollout.lora_sync import gather_adapter_pieces, local_adapter_tensors

        start = time.perf_counter()
        pieces = gather_adapter_pieces(local_adapter_tensors(self.engine.module), tp_group=self.info.tp_group,
                                       pp_group=self.info.pp_group)
        if self.adapter_sync is not None:
            replication = kv_replication_factor(self.spec.num_kv_heads, self.spec.num_heads, self.info.tp_size)
            self.adapter_sync.sync(pieces, self._actor_version, kv_replication=replication)
        self._adapter_seconds = time.perf_counter() - start

    # ------------------------------------------------------------------ registered methods
    @register(Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self, verify: bool = False,
                             bucket_mb: int = DEFAULT_WEIGHT_SYNC_BUCKET_MB) -> WeightSync:
        """Push the actor's weights into the engine if they changed since the last sync
        (collective: every rank, in lockstep).

        Args:
            verify: then generate greedily on a fixed probe and compare the engine's
                log-probs with the actor's recomputation (``rollout.verify_sync``).
            bucket_mb: the most MiB of converted tensors pushed into the engine at once
                (``rollout.weight_sync_bucket_mb``).

        Returns:
            This rank's :class:`~megaflow.workers.weight_sync.WeightSync`: the engine's weight
            version (syncs so far), the synced and current actor versions (equal after a
            sync); figures when weights moved: ``timing_s/reshard`` (the transition, seconds),
            ``reshard/bytes_received``, ``reshard/bytes_sent``, and colocated
            ``rollout/weight_sync_buckets`` and ``rollout/weight_sync_bucket_bytes`` (the
            largest bucket), split placement the ``transport/*`` figures; with ``verify``
            ``rollout/verify_sync_max_diff`` (the largest difference over all ranks).

        Raises:
            ValueError: ``bucket_mb <= 0``.
            RuntimeError: with ``verify``, a difference above ``model.dtype``'s tolerance
                (:func:`~megaflow.rollout.verify_sync.verify_sync_tolerance`; on every rank,
                naming the rank with the largest one).
        """
        if bucket_mb <= 0:
            raise ValueError(f"rollout.weight_sync_bucket_mb must be > 0, got {bucket_mb}")
        stale = self._synced_version != self._actor_version  # the engines serve an older actor version
        self._sync_rollout_weights(int(bucket_mb) << 20)
        figures = self._sync_figures() if stale else {}
        if verify:
            figures["rollout/verify_sync_max_diff"] = self._verify_sync()
        weight_version = self._num_sends if self.rollout is None else self.rollout.weight_version
        return WeightSync(weight_version, self._synced_version, self._actor_version, figures)

    def _verify_sync(self) -> float:
        """Every engine's log-probs of its greedy probe tokens vs the trainer's (collective).

        Each rank's engine generates on the probe; all ranks exchange their outputs and the
        trainer recomputes the log-probs of every rank's rows (the same batch on every rank,
        so the pipeline stages agree on their input and ranks of any stage are checked);
        the last stage's differences are shared with all ranks.

        Returns:
            The largest |engine - trainer| log-prob difference over all ranks' engines.

        Raises:
            RuntimeError: above ``model.dtype``'s tolerance
                (:func:`~megaflow.rollout.verify_sync.verify_sync_tolerance`; on every rank),
                naming the rank with the largest difference and listing every rank's.
        """
        host = self._engine_host()
        out = host.probe_rollout()
        keys = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")
        world = dist.get_world_size()
        outputs: list = [None] * world
        dist.all_gather_object(outputs, {k: out.tensors[k] for k in keys + ("rollout_log_probs",)})
        every = {k: torch.cat([o[k] for o in outputs]) for k in keys + ("rollout_log_probs",)}
        trainer = self._forward(DataProto.from_dict({k: every[k] for k in keys}), temperature=1.0)
        mine = None  # only the last pipeline stage has the trainer's log-probs
        if trainer is not None:
            delta = (every["rollout_log_probs"] - trainer["log_probs"].to(torch.float32).cpu()).abs()
            delta = torch.where(every["response_mask"].bool(), delta, torch.zeros_like(delta))
            mine = [float(rows.max()) for rows in delta.chunk(world)]
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        diffs = next(d for d in gathered if d is not None)
        worst = max(range(world), key=lambda r: diffs[r])
        tolerance = verify_sync_tolerance(self.config.model.dtype)
        if diffs[worst] > tolerance:
            raise RuntimeError(f"rollout.verify_sync: after weight sync {host.engine.weight_version} the engine's "
                               f"log-probs of the probe differ from the actor's by up to {diffs[worst]:.3g} on rank "
                               f"{worst} (tolerance {tolerance:g} for {self.config.model.dtype}); per rank: {diffs}")
        return float(diffs[worst])

    def _sync_figures(self) -> dict[str, float]:
        """What the last sync that moved weights moved: the reshard's figures, and the
        engine's bucket counts (colocated) or the transport's figures (a split source rank)."""
        s, t = self.last_reshard_stats, self.last_transport_stats
        figures = {} if self._adapter_seconds is None else {"timing_s/adapter_sync": self._adapter_seconds}
        if s is None:  # no sync has moved base weights yet, or an adapter-only sync
            return figures
        figures |= {"timing_s/reshard": s.seconds, "reshard/bytes_received": float(s.bytes_received),
                    "reshard/bytes_sent": float(s.bytes_sent)}
        if self.rollout is not None and t is not None:
            figures.update({"rollout/weight_sync_buckets": float(t.num_buckets),
                            "rollout/weight_sync_bucket_bytes": float(t.largest_bucket)})
        elif t is not None:
            figures.update(t.as_metrics())
        return figures

    @register(nd_compute("rollout"))
    def generate_sequences(self, prompts: DataProto) -> ProtoResult:
        """Rollout on this rank's generation replica (all ranks of a replica in lockstep).

        ``meta_info`` carries the sampling parameters (:mod:`megaflow.rollout.sampling`);
        its ``seed`` is offset by the replica index so that replicas draw distinct samples.
        Only generates: the caller syncs first (:meth:`sync_rollout_weights`).

        Returns:
            The engine's rows (:meth:`megaflow.rollout.vllm_rollout.VLLMRollout.generate_sequences`)
            and ``{"rollout/weight_version": engine syncs so far}``.

        Raises:
            RuntimeError: the engine serves weights older than the actor's (an update or
                checkpoint load since the last sync), naming both versions. The check is a
                comparison of two counters, so it is always on (with or without
                ``rollout.verify_sync``): stale weights are never sampled.
        """
        host = self._engine_host()
        if self._synced_version != self._actor_version:
            raise RuntimeError(f"generate_sequences on rank {self.rank}: the engine serves actor version "
                               f"{self._synced_version} (engine weight version {host.engine.weight_version}) but "
                               f"the actor is at version {self._actor_version}; call sync_rollout_weights() first")
        out = host.generate(prompts)
        return ProtoResult(out, {"rollout/weight_version": float(host.engine.weight_version)})

    @register(nd_compute("actor"))
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO update (see :class:`ActorWorker`); the rollout re-syncs before its next use."""
        metrics = super().update_actor(data)
        self._actor_version += 1
        return metrics

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore the actor (see :class:`ActorWorker`); the rollout re-syncs before its next use."""
        super().load_checkpoint(path)
        self._actor_version += 1

    @register(Dispatch.ONE_TO_ALL)
    def rollout_weight_version(self) -> int:
        """Number of weight syncs the engine has received."""
        return self._engine_host().engine.weight_version


def check_synced(per_rank: list[WeightSync]) -> dict[str, float]:
    """Controller-side check of a :meth:`ActorRolloutWorker.sync_rollout_weights` call.

    Args:
        per_rank: every rank's return value, index = rank.

    Returns:
        Rank 0's metrics (:meth:`~megaflow.workers.weight_sync.WeightSync.metrics`:
        ``rollout/weight_version`` and the reshard figures when weights moved).

    Raises:
        RuntimeError: a rank whose engine does not serve the actor's current version, or
            ranks whose engines received different numbers of syncs (naming the ranks).
    """
    stale = [r for r, m in enumerate(per_rank) if m.synced_actor_version != m.actor_version]
    if stale:
        raise RuntimeError(f"weight sync: the engines of ranks {stale} do not serve the actor's current weights "
                           f"(synced actor version {[per_rank[r].synced_actor_version for r in stale]}, "
                           f"actor version {[per_rank[r].actor_version for r in stale]})")
    versions = sorted({m.weight_version for m in per_rank})
    if len(versions) > 1:
        by_version = {v: [r for r, m in enumerate(per_rank) if m.weight_version == v] for v in versions}
        raise RuntimeError(f"weight sync: the engines disagree on their weight version (version: ranks) {by_version}")
    return per_rank[0].metrics()


__all__ = ["ActorRolloutWorker", "WeightSync", "stop_token_ids", "check_synced"]
