"""The actor with its colocated rollout engine: the 3D-HybridEngine in one worker.

Each rank holds its Megatron training shard (layout p-t-d, a
:class:`~megaflow.workers.megatron_role.MegatronRole`) and one vLLM engine shard of the
generation layout (p_g-t_g-d_g-d, a :class:`~megaflow.workers.rollout_host.RolloutHost`).
``sync_rollout_weights`` (a step of its own in ``RayPPOTrainer.train_step``) makes the engine
serve the actor's current weights through the rank's
:class:`~megaflow.workers.weight_sync.ActorWeightSync` (the sync loop split placement's actor
runs too): when the actor has changed since the last sync (an update, a checkpoint load,
start-up), the :class:`~megaflow.hybrid_engine.reshard.MicroDPResharder` all-gathers each
parameter inside its micro-DP group into the generation layout, the shard is converted to
vLLM's names and layouts (:mod:`megaflow.hybrid_engine.rollout_weights`) and loaded into the
engine in place (:class:`~megaflow.hybrid_engine.transport.ColocatedTransport`), and the
generation buffers are released again (train -> generate -> train). The engine's weight
version increments and its prefix cache is reset on every sync; the controller checks with
:func:`check_synced` that every rank serves the actor's version. With
``actor.lora.sync == "adapter"`` the resharder moves the frozen base once and every sync then
publishes only the LoRA adapters (:class:`~megaflow.rollout.lora_sync.AdapterSync`). The shard
travels in buckets of ``rollout.weight_sync_bucket_mb`` MiB, produced lazily from the
resharder (at most one bucket alive). ``generate_sequences`` only generates: it refuses to
run on weights older than the actor's.

Dispatch: ``generate_sequences`` is registered on the ``rollout`` mesh
(``dp_rank`` = generation replica, collected from generation TP rank 0), the actor's
other methods on the ``actor`` mesh (Megatron DP rank, collected from tp 0 / last stage).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megaflow.protocol import DataProto
from megaflow.rollout.verify_sync import verify_sync_tolerance
from megaflow.single_controller import Dispatch, ProtoResult, nd_compute, register
from megaflow.topology.role_spec import RoleSpec
from megaflow.workers.megatron_workers import MegatronWorker, frozen_base_log_probs, policy_log_probs, policy_update
from megaflow.workers.rollout_host import RolloutHost, stop_token_ids
from megaflow.workers.weight_sync import ActorWeightSync, WeightSync

#: Default of ``bucket_mb`` (``rollout.weight_sync_bucket_mb``): a 70B model's generation
#: shard at t_g = 8 (about 17 GB in bf16) streams in about 35 buckets, and its largest
#: tensor (the embedding shard, 128256 / 8 x 8192 x 2 bytes = 250 MiB) fits in one.
DEFAULT_WEIGHT_SYNC_BUCKET_MB = 512


class ActorRolloutWorker(MegatronWorker):
    """The actor with its vLLM engine shard, fed by the micro-DP resharder.

    Holds the actor's :class:`~megaflow.workers.megatron_role.MegatronRole` (as every Megatron
    worker), its :class:`~megaflow.workers.weight_sync.ActorWeightSync` (versions and the sync
    loop, through a colocated transport) and the rank's
    :class:`~megaflow.workers.rollout_host.RolloutHost` (the engine, its probe, seeded generation).

    The engine reads ``rollout`` (``tp`` = t_g, ``response_length``, ``gpu_memory_utilization``,
    ``sleep_level``, ``enforce_eager``, the CPU KV cache keys, ``ignore_eos``), ``data.max_prompt_length``,
    ``model.dtype`` and
    ``trainer.seed`` from the config; ``rollout.pp > 1`` is refused at load.

    Args:
        spec: the actor's :class:`~megaflow.topology.role_spec.RoleSpec`.
        eos_token_ids: the tokenizer's end-of-sequence ids (stop ids unless ``rollout.ignore_eos``).
        pad_token_id: the tokenizer's padding id (right-padding of responses, left-padding of prompts).
    """

    config_role, default_mesh = "actor", "actor"
    host: RolloutHost  # set by init_model, like weight_sync
    weight_sync: ActorWeightSync

    def __init__(self, spec: RoleSpec, eos_token_ids: tuple[int, ...], pad_token_id: int) -> None:
        super().__init__(spec)
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = int(pad_token_id)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the Megatron actor, the reshard groups and the vLLM engine (collective)."""
        self.role.build(self, self.mesh)
        self.weight_sync = sync = ActorWeightSync.build(self.role, self.rank)
        placement = sync.layout.ranks[self.rank]
        self.register_dp_info("rollout", dp_rank=placement.gen_dp_rank, is_collect=placement.is_collect)
        self.host = RolloutHost(self.config, self.role_spec.hf_config(), sync.spec, rank=self.rank,
                                tp_group_ranks=sync.layout.gen_tp_groups, gen_replica=placement.gen_dp_rank,
                                eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id)
        sync.use_engine(self.host.engine)  # the engine in this process: the sync loads it in place

    def close(self) -> None:
        """At shutdown: close the weight sync (:meth:`ActorWeightSync.close`: the adapter route's
        run directory), if ``init_model`` got that far."""
        sync: ActorWeightSync | None = getattr(self, "weight_sync", None)
        if sync is not None:
            sync.close()

    @register(nd_compute("actor"))
    def compute_log_prob(self, data: DataProto) -> DataProto | None:
        """``old_log_probs`` and ``entropys`` ``[B, R]`` at the rollout temperature."""
        return policy_log_probs(self.role, data)

    @register(nd_compute("actor"))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        """``ref_log_probs`` ``[B, R]`` of the frozen base (``actor.lora.rank > 0``; see
        :func:`~megaflow.workers.megatron_workers.frozen_base_log_probs`, which raises
        RuntimeError without LoRA)."""
        return frozen_base_log_probs(self.role, data)

    @register(nd_compute("actor"))
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO update (:func:`~megaflow.workers.megatron_workers.policy_update`; returns its
        metrics); the rollout re-syncs before its next use."""
        metrics = policy_update(self.role, data)
        self.weight_sync.actor_changed()
        return metrics

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore the actor (model, optimizer, LR schedule); the rollout re-syncs before its next use."""
        self.role.load_checkpoint(path)
        self.weight_sync.actor_changed()

    @register(Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self, verify: bool = False,
                             bucket_mb: int = DEFAULT_WEIGHT_SYNC_BUCKET_MB) -> WeightSync:
        """Push the actor's weights into the engine if they changed since the last sync
        (collective: every rank, in lockstep; :meth:`~megaflow.workers.weight_sync.ActorWeightSync.sync`).

        Args:
            verify: then generate greedily on a fixed probe and compare the engine's
                log-probs with the actor's recomputation (``rollout.verify_sync``).
            bucket_mb: the most MiB of converted tensors pushed into the engine at once
                (``rollout.weight_sync_bucket_mb``).

        Returns:
            This rank's :class:`~megaflow.workers.weight_sync.WeightSync`: the engine's weight
            version (syncs so far), the synced and current actor versions (equal after a
            sync); figures when weights moved: ``timing_s/reshard`` (the transition, seconds),
            ``reshard/bytes_received``, ``reshard/bytes_sent``, ``rollout/weight_sync_buckets``
            and ``rollout/weight_sync_bucket_bytes`` (the largest bucket); with ``verify``
            ``rollout/verify_sync_max_diff`` (the largest difference over all ranks).

        Raises:
            ValueError: ``bucket_mb <= 0``.
            RuntimeError: with ``verify``, a difference above ``model.dtype``'s tolerance
                (:func:`~megaflow.rollout.verify_sync.verify_sync_tolerance`; on every rank,
                naming the rank with the largest one).
        """
        return self.weight_sync.report(bucket_mb, self._verify_sync if verify else None)

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
        out = self.host.probe_rollout()
        keys = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")
        world = dist.get_world_size()
        outputs: list = [None] * world
        dist.all_gather_object(outputs, {k: out.tensors[k] for k in keys + ("rollout_log_probs",)})
        every = {k: torch.cat([o[k] for o in outputs]) for k in keys + ("rollout_log_probs",)}
        trainer = self.role.forward(DataProto.from_dict({k: every[k] for k in keys}), temperature=1.0)
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
            raise RuntimeError(f"rollout.verify_sync: after weight sync {self.host.engine.weight_version} the "
                               f"engine's log-probs of the probe differ from the actor's by up to {diffs[worst]:.3g} "
                               f"on rank {worst} (tolerance {tolerance:g} for {self.config.model.dtype}); per rank: "
                               f"{diffs}")
        return float(diffs[worst])

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
        sync, engine = self.weight_sync, self.host.engine
        if not sync.current:
            raise RuntimeError(f"generate_sequences on rank {self.rank}: the engine serves actor version "
                               f"{sync.synced_version} (engine weight version {engine.weight_version}) but "
                               f"the actor is at version {sync.actor_version}; call sync_rollout_weights() first")
        out = self.host.generate(prompts)
        return ProtoResult(out, {"rollout/weight_version": float(engine.weight_version)})

    @register(Dispatch.ONE_TO_ALL)
    def rollout_weight_version(self) -> int:
        """Number of weight syncs the engine has received."""
        return self.host.engine.weight_version


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
