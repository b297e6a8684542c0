"""Split placement: the rollout on its own resource pool, fed by the actor over a transport.

With ``resources.placement.rollout`` naming a pool other than the actor's, generation
leaves the actor's processes (the disaggregated layout of verl, NeMo-RL, slime, AReaL):

* :class:`RolloutWorker` - one rank of the rollout pool: a vLLM engine shard of
  TP = t_g (rollout rank ``r`` is TP rank ``r % t_g`` of replica ``r // t_g``: vLLM's
  consecutive TP groups in the rollout group's own ``torch.distributed`` world). Same
  ``generate_sequences`` contract and ``rollout`` dispatch mesh as
  :class:`~megaflow.workers.actor_rollout.ActorRolloutWorker`.
* :class:`SplitActorWorker` - the actor without an engine (a
  :class:`~megaflow.workers.megatron_role.MegatronRole` and the colocated actor's sync loop,
  :class:`~megaflow.workers.weight_sync.ActorWeightSync`): on a sync it reshards its
  training shard into the generation layout exactly as the colocated actor does
  (micro-DP all-gathers, :class:`~megaflow.hybrid_engine.reshard.MicroDPResharder`),
  converts it into buckets and, on the ranks of generation replica 0, broadcasts them to
  the rollout ranks (:class:`~megaflow.hybrid_engine.transport.BroadcastTransport`). It has
  no ``generate_sequences``: the rollout group generates.

The two groups rendezvous once (:func:`megaflow.trainer.rollout_source.connect_split`):
actor rank 0 opens a ``TCPStore``, then the source ranks and the rollout ranks build
one stateless process group per generation TP rank on it. Every sync is one call on
each group, in lockstep; the rollout ranks record the actor version the stream carried,
which the controller compares with the actor's (:func:`check_split_synced`).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from megaflow.protocol import DataProto
from megaflow.single_controller import Dispatch, ProtoResult, Worker, nd_compute, register
from megaflow.topology.role_spec import RoleSpec
from megaflow.workers.actor_rollout import DEFAULT_WEIGHT_SYNC_BUCKET_MB, check_synced
from megaflow.workers.megatron_workers import MegatronWorker, frozen_base_log_probs, policy_log_probs, policy_update
from megaflow.workers.rollout_host import RolloutHost
from megaflow.workers.weight_sync import ActorWeightSync, WeightSync

if TYPE_CHECKING:
    from megaflow.hybrid_engine.transport import BroadcastTransport, TransportPlan, TransportStats
    from megaflow.rollout.vllm_rollout import VLLMRollout

#: Seconds a transport collective may wait (rendezvous included).
TRANSPORT_TIMEOUT_S = 1800.0


def _open_store(host: str, port: int, *, is_master: bool):
    from datetime import timedelta

    from megaflow.single_controller.store import open_tcp_store

    return open_tcp_store(host, port, None, is_master=is_master, timeout=timedelta(seconds=TRANSPORT_TIMEOUT_S))


class RolloutWorker(Worker):
    """One rank of a standalone rollout group (a vLLM engine shard of TP = t_g).

    Reads ``rollout`` (``tp`` = t_g and the engine settings), ``data.max_prompt_length``,
    ``model.dtype`` and ``trainer.seed`` from the config, as the colocated engine does.

    Args:
        spec: the actor's :class:`~megaflow.topology.role_spec.RoleSpec` (the model served).
        eos_token_ids: the tokenizer's end-of-sequence ids (stop ids unless ``rollout.ignore_eos``).
        pad_token_id: the tokenizer's padding id.
    """

    host: RolloutHost  # set by init_model, like rollout (the host's engine)
    rollout: VLLMRollout
    transport: BroadcastTransport  # set by init_weight_transport

    def __init__(self, spec: RoleSpec, eos_token_ids: tuple[int, ...], pad_token_id: int) -> None:
        super().__init__()
        self.role_spec, self.config = spec, spec.config
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self._synced_actor_version = -1
        self.last_transport_stats: TransportStats | None = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join this group's world and build the engine (dummy weights until the first sync).

        Raises:
            ValueError: the group's size is not a multiple of ``rollout.tp``.
        """
        from megaflow.hybrid_engine import plan_hybrid_layout
        from megaflow.models.hf_mapping import ModelSpec

        gen_tp = self.config.rollout.tp
        if self.world_size % gen_tp:
            raise ValueError(f"rollout group of {self.world_size} ranks is not a multiple of rollout.tp={gen_tp}")
        self.init_distributed()
        hf_config = self.role_spec.hf_config()
        self.spec = ModelSpec.from_hf_config(hf_config)
        self._gen_tp_rank, self._gen_replica = self.rank % gen_tp, self.rank // gen_tp
        self.register_dp_info("rollout", dp_rank=self._gen_replica, is_collect=self._gen_tp_rank == 0)
        # The pool's own layout: replicas of TP = t_g on consecutive ranks, no micro-DP
        # (a "training" layout t = t_g, p = 1, d = replicas, whose generation layout is itself).
        self.layout = plan_hybrid_layout(gen_tp, 1, self.world_size // gen_tp, gen_tp,
                                         num_attention_heads=self.spec.num_heads,
                                         num_query_groups=self.spec.num_kv_heads)
        # the engine is built as the colocated actor builds its own (same settings, dummy weights)
        self.host = RolloutHost(self.config, hf_config, self.spec, rank=self.rank,
                                tp_group_ranks=self.layout.gen_tp_groups, gen_replica=self._gen_replica,
                                eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id)
        self.rollout = self.host.engine

    @register(Dispatch.ONE_TO_ALL)
    def sharded_param_shapes(self) -> dict[str, tuple[int, ...]]:
        """vLLM name -> this rank's shard shape (what the actor must send to TP rank ``rank % t_g``)."""
        return self.rollout.sharded_param_shapes()

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_transport(self, host: str, port: int, plan: TransportPlan, backend: str) -> None:
        """Join this rank's broadcast group of ``plan`` (blocks until all members joined)."""
        from megaflow.hybrid_engine.transport import BroadcastTransport, stateless_process_group

        group = plan.group_of_rollout(self.rank)
        rank_in_group = group.rank_of_rollout(self.rank)
        if rank_in_group is None:  # (group_of_rollout found the group by this rank)
            raise RuntimeError(f"rollout rank {self.rank} is no receiver of its transport group {group}")
        store = _open_store(host, port, is_master=False)
        pg = stateless_process_group(store, rank_in_group, 1 + len(group.receivers),
                                     backend=backend, prefix=f"tp{group.gen_tp_rank}",
                                     timeout_s=TRANSPORT_TIMEOUT_S)
        self._store, self.transport = store, BroadcastTransport(pg, backend)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> WeightSync:
        """Receive one sync from the actor (collective with the actor's
        :meth:`SplitActorWorker.sync_rollout_weights`).

        Returns:
            The engine's weight version (syncs so far), the actor version it serves and,
            when weights moved, the ``transport/*`` figures and ``timing_s/transport``.
        """
        stats, changed = self.transport.receive(self.rollout)
        self._synced_actor_version = stats.version
        if changed:
            self.last_transport_stats = stats
        return WeightSync(self.rollout.weight_version, self._synced_actor_version,
                          figures=stats.as_metrics() if changed else {})

    @register(nd_compute("rollout"))
    def generate_sequences(self, prompts: DataProto) -> ProtoResult:
        """Rollout on this rank's replica (the ranks of a replica in lockstep).

        Same contract as :meth:`ActorRolloutWorker.generate_sequences` (``meta_info``
        sampling parameters, seed offset per replica), plus ``weight_version`` ``[B]``
        (int64): the actor version of the weights that generated each row. The metrics
        hold the engine's weight version and ``timeline/gen_start_unix`` /
        ``timeline/gen_end_unix`` (wall clock, seconds since the epoch).

        Raises:
            RuntimeError: no weights were received yet.
        """
        if self._synced_actor_version < 0:
            raise RuntimeError("rollout worker: generate_sequences before the first weight sync")
        start = time.time()
        out = self.host.generate(prompts)
        out.tensors["weight_version"] = torch.full((len(out),), self._synced_actor_version, dtype=torch.int64)
        return ProtoResult(out, {"rollout/weight_version": float(self.rollout.weight_version),
                                 "timeline/gen_start_unix": start, "timeline/gen_end_unix": time.time()})

    @register(Dispatch.ONE_TO_ALL)
    def rollout_weight_version(self) -> int:
        """Number of weight syncs the engine has received."""
        return self.rollout.weight_version

    @register(Dispatch.ONE_TO_ALL)
    def probe_rollout(self) -> DataProto:
        """Greedy rollout of the fixed probe (``rollout.verify_sync``; every replica
        generates it); each rank returns its replica's output."""
        return self.host.probe_rollout()


class SplitActorWorker(MegatronWorker):
    """The actor of split placement: no engine; its syncs broadcast to a rollout group.

    Holds the actor's :class:`~megaflow.workers.megatron_role.MegatronRole` and an
    :class:`~megaflow.workers.weight_sync.ActorWeightSync` (the colocated actor's sync loop)
    whose transport, on the source ranks, is a
    :class:`~megaflow.hybrid_engine.transport.BroadcastTransport`; it generates nothing (the
    rollout group does).

    Args: as for :class:`~megaflow.workers.actor_rollout.ActorRolloutWorker` (the token ids
    are not used: the rollout group's engines stop and pad).
    """

    config_role, default_mesh = "actor", "actor"
    weight_sync: ActorWeightSync  # set by init_model

    def __init__(self, spec: RoleSpec, eos_token_ids: tuple[int, ...], pad_token_id: int) -> None:
        super().__init__(spec)
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self._store: Any = None  # the transport's TCPStore client (rank 0: its server)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the Megatron actor and the reshard groups (collective)."""
        self.role.build(self, self.mesh)
        self.weight_sync = ActorWeightSync.build(self.role, self.rank)

    @register(nd_compute("actor"))
    def compute_log_prob(self, data: DataProto) -> DataProto | None:
        """``old_log_probs`` and ``entropys`` ``[B, R]`` at the rollout temperature."""
        return policy_log_probs(self.role, data)

    @register(nd_compute("actor"))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        """``ref_log_probs`` ``[B, R]`` of the frozen base (``actor.lora.rank > 0``; see
        :func:`~megaflow.workers.megatron_workers.frozen_base_log_probs`)."""
        return frozen_base_log_probs(self.role, data)

    @register(nd_compute("actor"))
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO update (:func:`~megaflow.workers.megatron_workers.policy_update`; returns its
        metrics); the rollout group is re-synced before its next use."""
        metrics = policy_update(self.role, data)
        self.weight_sync.actor_changed()
        return metrics

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore the actor (model, optimizer, LR schedule); the rollout group is re-synced
        before its next use."""
        self.role.load_checkpoint(path)
        self.weight_sync.actor_changed()

    @register(Dispatch.RANK_ZERO)
    def open_weight_store(self) -> tuple[str, int]:
        """Start the transport's ``TCPStore`` on this rank (rank 0); returns ``(host, port)``."""
        host = self.master_addr  # this rank's node: the group's rendezvous address
        self._store = _open_store(host, 0, is_master=True)
        return host, int(self._store.port)

    @register(Dispatch.ONE_TO_ALL)
    def init_weight_transport(self, host: str, port: int, plan: TransportPlan, vllm_shapes: list,
                              backend: str) -> None:
        """Join the broadcast group this rank is the source of, if any (blocks until its
        members joined); ``vllm_shapes[j]``: the shard shapes of generation TP rank ``j``."""
        from megaflow.hybrid_engine.transport import BroadcastTransport, stateless_process_group

        sync = self.weight_sync
        group = plan.group_of_actor(self.rank)
        if group is None:
            sync.use_transport(None, vllm_shapes[sync.gen_tp_rank])
            return
        if self._store is None:
            self._store = _open_store(host, port, is_master=False)
        pg = stateless_process_group(self._store, 0, 1 + len(group.receivers), backend=backend,
                                     prefix=f"tp{group.gen_tp_rank}", timeout_s=TRANSPORT_TIMEOUT_S)
        sync.use_transport(BroadcastTransport(pg, backend), vllm_shapes[sync.gen_tp_rank])

    @register(Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self, verify: bool = False,
                             bucket_mb: int = DEFAULT_WEIGHT_SYNC_BUCKET_MB) -> WeightSync:
        """Reshard the actor's weights and broadcast them to the rollout group if they changed
        since the last sync (collective with the rollout group's :meth:`RolloutWorker.receive_weights`).

        Args:
            verify: must be False: under split placement the controller verifies the sync
                (:func:`megaflow.trainer.rollout_source.verify_split_sync`).
            bucket_mb: the most MiB of converted tensors broadcast at once.

        Returns:
            This rank's :class:`~megaflow.workers.weight_sync.WeightSync` (weight version: the
            syncs this rank has run); figures when weights moved: the reshard's and, on a
            source rank, the ``transport/*`` figures.

        Raises:
            RuntimeError: ``verify`` is set.
            ValueError: ``bucket_mb <= 0``.
        """
        if verify:
            raise RuntimeError("split placement: the controller verifies the sync (rollout_source.verify_split_sync), "
                               "call sync_rollout_weights(verify=False)")
        return self.weight_sync.report(bucket_mb)

    @register(Dispatch.ONE_TO_ALL)
    def rollout_weight_version(self) -> int:
        """Number of syncs this rank has sent (or, off the sources, produced)."""
        return self.weight_sync.num_sends


def check_split_synced(actor: list[WeightSync], rollout: list[WeightSync]) -> dict[str, float]:
    """Controller-side check of one split-placement sync.

    Args:
        actor: every actor rank's :meth:`SplitActorWorker.sync_rollout_weights` result.
        rollout: every rollout rank's :meth:`RolloutWorker.receive_weights` result.

    Returns:
        Actor rank 0's metrics (reshard and transport figures) with the rollout group's
        ``rollout/weight_version`` and the largest ``transport/bytes_received`` of a rank.

    Raises:
        RuntimeError: an actor rank that did not sync (see :func:`check_synced`), a rollout
            rank whose engine serves another actor version than the actor's, or rollout
            engines with different sync counts (ranks named).
    """
    metrics = check_synced(actor)
    version = actor[0].actor_version
    stale = [r for r, m in enumerate(rollout) if m.synced_actor_version != version]
    if stale:
        raise RuntimeError(f"weight sync: rollout ranks {stale} serve actor version "
                           f"{[rollout[r].synced_actor_version for r in stale]}, the actor is at {version}")
    if len({m.weight_version for m in rollout}) > 1:
        raise RuntimeError(f"weight sync: the rollout engines disagree on their weight version "
                           f"{[m.weight_version for m in rollout]} (index = rollout rank)")
    metrics["rollout/weight_version"] = float(rollout[0].weight_version)
    received = [m.figures["transport/bytes_received"] for m in rollout if "transport/bytes_received" in m.figures]
    if received:
        metrics["transport/bytes_received"] = max(received)
    return metrics


__all__ = ["RolloutWorker", "SplitActorWorker", "check_split_synced"]
