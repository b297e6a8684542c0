"""Split placement: the rollout on its own resource pool, fed by the actor over a transport.

With ``resources.placement.rollout`` naming a pool other than the actor's, generation
leaves the actor's processes (the disaggregated layout of verl, NeMo-RL, slime, AReaL):

* :class:`RolloutWorker` - one rank of the rollout pool: a vLLM engine shard of
  TP = t_g (rollout rank ``r`` is TP rank ``r % t_g`` of replica ``r // t_g``: vLLM's
  consecutive TP groups in the rollout group's own ``torch.distributed`` world). Same
  ``generate_sequences`` contract and ``rollout`` dispatch mesh as
  :class:`~megaflow.workers.actor_rollout.ActorRolloutWorker`.
* :class:`SplitActorWorker` - the actor without an engine: on a sync it reshards its
  training shard into the generation layout exactly as the colocated actor does
  (micro-DP all-gathers, :class:`~megaflow.hybrid_engine.reshard.MicroDPResharder`),
  converts it into buckets and, on the ranks of generation replica 0, broadcasts them to
  the rollout ranks (:class:`~megaflow.hybrid_engine.transport.BroadcastTransport`).

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
from megaflow.workers.actor_rollout import ActorRolloutWorker, check_synced
from megaflow.workers.rollout_host import RolloutHost
from megaflow.workers.weight_sync import WeightSync

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


class SplitActorWorker(ActorRolloutWorker):
    """The actor of split placement: no engine; its syncs broadcast to a rollout group.

    Args: as for :class:`ActorRolloutWorker`.
    """

    def _build_host(self, hf_config: Any, gen_replica: int) -> None:
        return None  # the engines live on the rollout pool

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

        self._vllm_shapes = vllm_shapes[self._gen_tp_rank]
        group = plan.group_of_actor(self.rank)
        if group is None:
            return
        if not hasattr(self, "_store"):
            self._store = _open_store(host, port, is_master=False)
        pg = stateless_process_group(self._store, 0, 1 + len(group.receivers), backend=backend,
                                     prefix=f"tp{group.gen_tp_rank}", timeout_s=TRANSPORT_TIMEOUT_S)
        self.transport = BroadcastTransport(pg, backend)

    def _verify_sync(self) -> float:
        raise RuntimeError("split placement: the controller verifies the sync (rollout_source.verify_split_sync)")

    @register(nd_compute("rollout"))
    def generate_sequences(self, prompts: DataProto) -> ProtoResult:
        """Refused: with split placement the rollout group generates."""
        raise RuntimeError("split placement (resources.placement.rollout): the actor has no engine; "
                           "call the rollout group's generate_sequences")

    @register(Dispatch.ONE_TO_ALL)
    def rollout_weight_version(self) -> int:
        """Number of syncs this rank has sent (or, off the sources, produced)."""
        return self._num_sends


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
