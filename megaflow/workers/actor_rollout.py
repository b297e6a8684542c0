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
The shard travels in buckets of ``rollout.weight_sync_bucket_mb`` MiB, produced lazily
from the resharder (at most one bucket alive). ``generate_sequences`` only generates: it
refuses to run on weights older than the actor's.

Dispatch: ``generate_sequences`` is registered on the ``rollout`` mesh
(``dp_rank`` = generation replica, collected from generation TP rank 0), the actor's
other methods on the ``actor`` mesh (Megatron DP rank, collected from tp 0 / last stage).
"""
from __future__ import annotations

import json
import os
import tempfile
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from megaflow.protocol import DataProto
from megaflow.single_controller import Dispatch, ProtoResult, nd_compute, register
from megaflow.topology.role_spec import RoleSpec
from megaflow.workers.megatron_workers import ActorWorker

if TYPE_CHECKING:
    from megaflow.config.schema import Config

#: Offset between the sampling seeds of two generation replicas (distinct request seeds).
_REPLICA_SEED_STRIDE = 1_000_003
#: ``verify`` of :meth:`ActorRolloutWorker.sync_rollout_weights`: largest accepted
#: |engine - trainer| log-prob difference on the probe (fp32).
VERIFY_SYNC_ATOL = 1e-5
_PROBE_LENGTHS, _PROBE_RESPONSE = (8, 5), 8
#: Default of ``bucket_mb`` (``rollout.weight_sync_bucket_mb``): a 70B model's generation
#: shard at t_g = 8 (about 17 GB in bf16) streams in about 35 buckets, and its largest
#: tensor (the embedding shard, 128256 / 8 x 8192 x 2 bytes = 250 MiB) fits in one.
DEFAULT_WEIGHT_SYNC_BUCKET_MB = 512


def stop_token_ids(cfg: Config, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's EOS ids, or none with ``rollout.ignore_eos``
    (every response is then ``rollout.response_length`` tokens)."""
    return () if cfg.rollout.ignore_eos else tuple(int(i) for i in eos_token_ids)


class ActorRolloutWorker(ActorWorker):
    """:class:`ActorWorker` plus a vLLM engine fed by the micro-DP resharder.

    The engine reads ``rollout`` (``tp`` = t_g, ``response_length``, ``gpu_memory_utilization``,
    the CPU KV cache keys, ``ignore_eos``), ``data.max_prompt_length``, ``model.dtype`` and
    ``trainer.seed`` from the config; ``rollout.pp > 1`` is refused at load.

    Args:
        spec: the actor's :class:`~megaflow.topology.role_spec.RoleSpec`.
        eos_token_ids: the tokenizer's end-of-sequence ids (stop ids unless ``rollout.ignore_eos``).
        pad_token_id: the tokenizer's padding id (right-padding of responses, left-padding of prompts).
    """

    def __init__(self, spec: RoleSpec, eos_token_ids: tuple[int, ...], pad_token_id: int) -> None:
        super().__init__(spec)
        self.eos_token_ids = stop_token_ids(spec.config, eos_token_ids)
        self.pad_token_id = int(pad_token_id)
        self.rollout = None
        self.resharder = None
        self._actor_version = 0
        self._synced_version = -1
        self.last_reshard_stats = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Build the Megatron actor, the reshard groups and the vLLM engine (collective)."""
        from megaflow.hybrid_engine import MicroDPResharder, build_reshard_groups, plan_hybrid_layout
        from megaflow.models.hf_mapping import ModelSpec

        super().init_model()
        rollout, info = self.config.rollout, self.info
        hf_config = self.role_spec.hf_config()
        self.spec = ModelSpec.from_hf_config(hf_config)
        self.layout = plan_hybrid_layout(info.tp_size, info.pp_size, info.dp_size, rollout.tp, rollout.pp,
                                         num_attention_heads=self.spec.num_heads,
                                         num_query_groups=self.spec.num_kv_heads)
        self.reshard_groups = build_reshard_groups(self.layout)
        self.resharder = MicroDPResharder(self.reshard_groups, dict(self.engine.module.named_parameters()),
                                          share_embeddings_and_output_weights=self.spec.tie_word_embeddings)
        placement = self.layout.ranks[self.rank]
        self.register_dp_info("rollout", dp_rank=placement.gen_dp_rank, is_collect=placement.is_collect)
        self._gen_tp_rank = placement.gen_tp_rank
        self._gen_replica = placement.gen_dp_rank
        self.rollout = self._build_engine(hf_config)

    def _build_engine(self, hf_config):
        from megaflow.dryrun.memory import cpu_kv_cache_bytes
        from megaflow.rollout.sampling import SamplingConfig
        from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig
        from megaflow.topology.sizes import max_seq_len

        cfg = self.config
        model_dir = self._engine_model_dir(hf_config)
        engine_cfg = VLLMRolloutConfig(
            model_path=model_dir, tp_size=cfg.rollout.tp, tp_group_ranks=self.layout.gen_tp_groups,
            dtype=cfg.model.dtype, load_format="dummy", max_model_len=max_seq_len(cfg),
            kv_cache_bytes=None if cfg.resources.use_gpu else cpu_kv_cache_bytes(cfg),
            gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, seed=cfg.trainer.seed,
            logprobs_mode=f"{cfg.rollout.logprobs_mode}_logprobs")
        # Each call's meta_info overrides the sampling parameters; n stays 1 (the controller
        # repeats every prompt rollout.n times).
        sampling = SamplingConfig(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                                  top_k=cfg.rollout.top_k, response_length=cfg.rollout.response_length,
                                  eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id)
        return VLLMRollout(engine_cfg, sampling)

    def _engine_model_dir(self, hf_config) -> str:
        """A directory with the model's ``config.json`` for vLLM (weights come from the actor)."""
        cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
        path = tempfile.mkdtemp(prefix=f"megaflow_rollout_rank{self.rank}_")
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
        return path

    # ------------------------------------------------------------------ weight sync
    def _sync_rollout_weights(self, bucket_bytes: int) -> None:
        """train -> generate -> train: stream the actor's current weights into the engine.

        The generation shard is produced by the resharder, converted to vLLM's names and
        local layout and pushed in buckets of at most ``bucket_bytes``
        (:func:`~megaflow.hybrid_engine.rollout_weights.iter_vllm_buckets`); at most one
        bucket is alive at a time. Parameters only are reloaded onto the device.
        """
        if self._synced_version == self._actor_version:
            return
        from megaflow.hybrid_engine.rollout_weights import iter_vllm_buckets
        from megaflow.hybrid_engine.transport import load_buckets

        self._before_phase(("params",))  # the sync reads parameters only: grads/optimizer stay offloaded
        try:
            with self.resharder.generation() as stats:
                buckets = iter_vllm_buckets(
                    self.resharder.named_generation_tensors(), self.spec, gen_tp=self.layout.gen_tp,
                    gen_tp_rank=self._gen_tp_rank, vllm_shapes=self.rollout.sharded_param_shapes(),
                    gather_vocab=self._gather_gen_tp, bucket_bytes=bucket_bytes)
                # a failure aborts the update: the engine refuses to generate until a complete sync
                num_buckets, _, largest = load_buckets(self.rollout, buckets)
        finally:
            self._after_phase()  # the training state goes back off the device while the engine generates
        self.last_reshard_stats = stats
        self.last_sync_buckets = (num_buckets, largest)
        self._synced_version = self._actor_version

    def _gather_gen_tp(self, shard: torch.Tensor) -> torch.Tensor:
        """All-gather ``shard`` over the generation TP group along dim 0 (identity at t_g = 1)."""
        from megaflow.hybrid_engine.rollout_weights import gather_rows

        return gather_rows(shard, self.reshard_groups.gen_tp)

    # ------------------------------------------------------------------ registered methods
    @register(Dispatch.ONE_TO_ALL)
    def sync_rollout_weights(self, verify: bool = False,
                             bucket_mb: int = DEFAULT_WEIGHT_SYNC_BUCKET_MB) -> dict[str, float]:
        """Push the actor's weights into the engine if they changed since the last sync
        (collective: every rank, in lockstep).

        Args:
            verify: then generate greedily on a fixed probe and compare the engine's
                log-probs with the actor's recomputation (``rollout.verify_sync``).
            bucket_mb: the most MiB of converted tensors pushed into the engine at once
                (``rollout.weight_sync_bucket_mb``).

        Returns:
            This rank's ``rollout/weight_version`` (engine syncs so far),
            ``rollout/synced_actor_version`` and ``rollout/actor_version`` (equal after a
            sync), when weights moved ``timing_s/reshard`` (the transition, seconds),
            ``reshard/bytes_received``, ``reshard/bytes_sent``, ``rollout/weight_sync_buckets``
            and ``rollout/weight_sync_bucket_bytes`` (the largest bucket), and with ``verify``
            ``rollout/verify_sync_max_diff`` (the largest difference over all ranks).

        Raises:
            ValueError: ``bucket_mb <= 0``.
            RuntimeError: with ``verify``, a difference above :data:`VERIFY_SYNC_ATOL`
                (on every rank, naming the rank with the largest one).
        """
        if bucket_mb <= 0:
            raise ValueError(f"rollout.weight_sync_bucket_mb must be > 0, got {bucket_mb}")
        stale = self._synced_version != self._actor_version  # the engines serve an older actor version
        self._sync_rollout_weights(int(bucket_mb) << 20)
        metrics = self._sync_metrics(stale)
        if verify:
            metrics["rollout/verify_sync_max_diff"] = self._verify_sync()
        return metrics

    def _probe(self) -> DataProto:
        """Fixed left-padded prompts (seeded ids from 3 up to the vocabulary), greedy."""
        lengths = [min(n, self.config.data.max_prompt_length) for n in _PROBE_LENGTHS]
        width = max(lengths)
        gen = torch.Generator().manual_seed(0)
        ids = torch.full((len(lengths), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, width - n:] = torch.randint(3, self.spec.vocab_size, (n,), generator=gen)
            mask[i, width - n:] = 1
        return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, meta_info={
            "do_sample": False, "response_length": min(_PROBE_RESPONSE, self.config.rollout.response_length),
            "seed": 0})

    def _verify_sync(self) -> float:
        """Every engine's log-probs of its greedy probe tokens vs the trainer's (collective).

        Each rank's engine generates on the probe; all ranks exchange their outputs and the
        trainer recomputes the log-probs of every rank's rows (the same batch on every rank,
        so the pipeline stages agree on their input and ranks of any stage are checked);
        the last stage's differences are shared with all ranks.

        Returns:
            The largest |engine - trainer| log-prob difference over all ranks' engines.

        Raises:
            RuntimeError: above :data:`VERIFY_SYNC_ATOL` (on every rank), naming the rank
                with the largest difference and listing every rank's.
        """
        out = self.rollout.generate_sequences(self._probe())
        keys = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")
        world = dist.get_world_size()
        outputs: list = [None] * world
        dist.all_gather_object(outputs, {k: out.batch[k] for k in keys + ("rollout_log_probs",)})
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
        if diffs[worst] > VERIFY_SYNC_ATOL:
            raise RuntimeError(f"rollout.verify_sync: after weight sync {self.rollout.weight_version} the engine's "
                               f"log-probs of the probe differ from the actor's by up to {diffs[worst]:.3g} on rank "
                               f"{worst} (tolerance {VERIFY_SYNC_ATOL:g}); per rank: {diffs}")
        return float(diffs[worst])

    def _sync_metrics(self, stale: bool) -> dict[str, float]:
        """Version metrics; with ``stale`` (this call moved the weights) also the reshard's."""
        metrics = {"rollout/weight_version": float(self.rollout.weight_version),
                   "rollout/synced_actor_version": float(self._synced_version),
                   "rollout/actor_version": float(self._actor_version)}
        if stale and self.last_reshard_stats is not None:
            s = self.last_reshard_stats
            metrics.update({"timing_s/reshard": s.seconds, "reshard/bytes_received": float(s.bytes_received),
                            "reshard/bytes_sent": float(s.bytes_sent),
                            "rollout/weight_sync_buckets": float(self.last_sync_buckets[0]),
                            "rollout/weight_sync_bucket_bytes": float(self.last_sync_buckets[1])})
        return metrics

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
        if self._synced_version != self._actor_version:
            raise RuntimeError(f"generate_sequences on rank {self.rank}: the engine serves actor version "
                               f"{self._synced_version} (engine weight version {self.rollout.weight_version}) but "
                               f"the actor is at version {self._actor_version}; call sync_rollout_weights() first")
        meta = dict(prompts.meta_info)
        if meta.get("seed") is not None:
            meta["seed"] = int(meta["seed"]) + self._gen_replica * _REPLICA_SEED_STRIDE
        out = self.rollout.generate_sequences(DataProto(prompts.batch, prompts.non_tensor_batch, meta))
        return ProtoResult(out, {"rollout/weight_version": float(self.rollout.weight_version)})

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
        return self.rollout.weight_version


def check_synced(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Controller-side check of a :meth:`ActorRolloutWorker.sync_rollout_weights` call.

    Args:
        per_rank: every rank's return value, index = rank.

    Returns:
        The metrics of rank 0 (``rollout/weight_version`` and the reshard figures when
        weights moved), without the version bookkeeping.

    Raises:
        RuntimeError: a rank whose engine does not serve the actor's current version, or
            ranks whose engines received different numbers of syncs (naming the ranks).
    """
    stale = [r for r, m in enumerate(per_rank) if m["rollout/synced_actor_version"] != m["rollout/actor_version"]]
    if stale:
        raise RuntimeError(f"weight sync: the engines of ranks {stale} do not serve the actor's current weights "
                           f"(synced actor version {[per_rank[r]['rollout/synced_actor_version'] for r in stale]}, "
                           f"actor version {[per_rank[r]['rollout/actor_version'] for r in stale]})")
    versions = sorted({m["rollout/weight_version"] for m in per_rank})
    if len(versions) > 1:
        by_version = {v: [r for r, m in enumerate(per_rank) if m["rollout/weight_version"] == v] for v in versions}
        raise RuntimeError(f"weight sync: the engines disagree on their weight version (version: ranks) {by_version}")
    return {k: v for k, v in per_rank[0].items()
            if k not in ("rollout/synced_actor_version", "rollout/actor_version")}


__all__ = ["ActorRolloutWorker", "stop_token_ids", "check_synced", "VERIFY_SYNC_ATOL"]
