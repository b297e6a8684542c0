"""One rank's rollout engine: built from the config, probed, generating with a replica's seed.

Held by both workers that generate: the colocated actor
(:class:`~megaflow.workers.actor_rollout.ActorRolloutWorker`, the engine shard in the
actor's process) and the standalone rollout worker of split placement
(:class:`~megaflow.workers.rollout_worker.RolloutWorker`). The engine starts with dummy
weights; the weight sync fills it (:mod:`megaflow.hybrid_engine.transport`).
"""
from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from megaflow.protocol import DataProto

if TYPE_CHECKING:
    from megaflow.config.schema import Config
    from megaflow.models.hf_mapping import ModelSpec
    from megaflow.rollout.vllm_rollout import VLLMRollout

#: Offset between the sampling seeds of two generation replicas (distinct request seeds).
REPLICA_SEED_STRIDE = 1_000_003
#: The verification probe: prompt lengths (capped at ``data.max_prompt_length``) and
#: response length (capped at ``rollout.response_length``).
PROBE_LENGTHS, PROBE_RESPONSE = (8, 5), 8


def stop_token_ids(cfg: Config, eos_token_ids: tuple[int, ...]) -> tuple[int, ...]:
    """The ids that end a response: the tokenizer's EOS ids, or none with ``rollout.ignore_eos``
    (every response is then ``rollout.response_length`` tokens)."""
    return () if cfg.rollout.ignore_eos else tuple(int(i) for i in eos_token_ids)


def engine_model_dir(hf_config: Any, rank: int) -> str:
    """A fresh directory with the model's ``config.json`` for vLLM (weights come from the actor).

    Args:
        hf_config: the model's Hugging Face config (a ``PretrainedConfig`` or its dict).
        rank: the worker's rank (named in the directory).
    """
    cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    path = tempfile.mkdtemp(prefix=f"megaflow_rollout_rank{rank}_")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return path


def adapter_engine_settings(cfg: Config) -> tuple[int, int]:
    """The engine's ``(max_lora_rank, max_lora_versions)``: ``(0, 1)`` (no LoRA) unless
    ``actor.lora.sync == "adapter"``, then adapters up to
    ``actor.lora.rank``, and ``staleness + 2`` adapter slots
    (:class:`~megaflow.rollout.lora_sync.AdapterSync`) with staleness 0: the route runs colocated only
    (split placement, and so async rollouts, is refused at load), so rollouts use the newest adapter."""
    lora = cfg.actor.lora
    if lora.rank == 0 or lora.sync != "adapter":
        return 0, 1
    return lora.rank, 2


def returns_routed_experts(cfg: Config, hf_config: Any) -> bool:
    """Whether the engine returns ``routed_experts`` (:mod:`megaflow.rollout.routing`): for every
    mixture-of-experts model (the ``moe/routing_agreement`` metric under every
    ``actor.router_replay``, the replayed routing under R3), except in multi-turn rollouts
    (``rollout.agent.enabled``, whose observation tokens the engine never routes; R3 is refused
    there at load). The cost is the top-k ids in a compact integer dtype
    (:func:`~megaflow.rollout.routing.routed_experts_dtype`), ``[rows, seq, moe_layers, topk]``.

    Args:
        hf_config: the served model's Hugging Face config (a ``PretrainedConfig`` or its dict).
    """
    from megaflow.topology.model_spec import model_spec

    return model_spec(hf_config).is_moe and not cfg.rollout.agent.enabled


def build_engine(cfg: Config, hf_config: Any, *, rank: int, tp_group_ranks: Sequence[Sequence[int]],
                 eos_token_ids: tuple[int, ...], pad_token_id: int) -> VLLMRollout:
    """The vLLM engine shard of one rank, with dummy weights.

    Reads ``rollout`` (``tp`` = t_g, ``response_length``, ``gpu_memory_utilization``,
    ``sleep_level``, ``enforce_eager``, ``logprobs_mode``, the
    sampling defaults, the CPU KV cache keys), ``data.max_prompt_length``, ``model.dtype``,
    ``resources.use_gpu`` and ``trainer.seed``. A mixture-of-experts model's engine returns
    ``routed_experts`` on every single-turn rollout (:func:`returns_routed_experts`); with
    ``actor.router_replay=R3`` prefix caching is off (a cached prompt token is not routed, and
    R3 replays every token's routing).
    Each call's ``meta_info`` overrides the sampling parameters; ``n`` stays 1 (the
    controller repeats every prompt ``rollout.n`` times).

    Args:
        tp_group_ranks: the generation TP groups (global ranks), one list per replica.
        eos_token_ids: the stop ids (:func:`stop_token_ids`).
        pad_token_id: the id written after each response and left of each prompt.
    """
    from megaflow.dryrun.memory import cpu_kv_cache_bytes
    from megaflow.rollout.sampling import SamplingConfig
    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig
    from megaflow.topology.sizes import max_seq_len, rollout_sleep_level

    lora_rank, lora_versions = adapter_engine_settings(cfg)
    replay = cfg.actor.router_replay == "R3"  # the trainer replays the engine's routing: every token routed
    engine_cfg = VLLMRolloutConfig(
        model_path=engine_model_dir(hf_config, rank), tp_size=cfg.rollout.tp,
        tp_group_ranks=tuple(tuple(g) for g in tp_group_ranks),
        dtype=cfg.model.dtype, load_format="dummy", max_model_len=max_seq_len(cfg),
        kv_cache_bytes=None if cfg.resources.use_gpu else cpu_kv_cache_bytes(cfg),
        gpu_memory_utilization=cfg.rollout.gpu_memory_utilization, seed=cfg.trainer.seed,
        sleep_level=rollout_sleep_level(cfg), enforce_eager=cfg.rollout.enforce_eager,
        logprobs_mode=f"{cfg.rollout.logprobs_mode}_logprobs", max_lora_rank=lora_rank, max_lora_versions=lora_versions,
        return_routed_experts=returns_routed_experts(cfg, hf_config), enable_prefix_caching=not replay)
    sampling = SamplingConfig(temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
                              top_k=cfg.rollout.top_k, response_length=cfg.rollout.response_length,
                              eos_token_ids=eos_token_ids, pad_token_id=pad_token_id)
    return VLLMRollout(engine_cfg, sampling)


class RolloutHost:
    """One rank's engine shard of generation replica ``gen_replica``.

    Args:
        cfg: the run's config.
        hf_config: the served model's Hugging Face config.
        spec: the served model's :class:`~megaflow.models.hf_mapping.ModelSpec`.
        rank: the worker's rank.
        tp_group_ranks: the generation TP groups (global ranks).
        gen_replica: this rank's generation replica (its seed offset).
        eos_token_ids: the tokenizer's end-of-sequence ids (stop ids unless ``rollout.ignore_eos``).
        pad_token_id: the tokenizer's padding id.
    """

    def __init__(self, cfg: Config, hf_config: Any, spec: ModelSpec, *, rank: int,
                 tp_group_ranks: Sequence[Sequence[int]], gen_replica: int, eos_token_ids: tuple[int, ...],
                 pad_token_id: int) -> None:
        self.cfg, self.spec, self.gen_replica, self.pad_token_id = cfg, spec, gen_replica, int(pad_token_id)
        self.engine = build_engine(cfg, hf_config, rank=rank, tp_group_ranks=tp_group_ranks,
                                   eos_token_ids=stop_token_ids(cfg, eos_token_ids), pad_token_id=self.pad_token_id)
        self.agent = None  # rollout.agent.enabled: multi-turn rollouts (megaflow.workers.agent_hook)
        if cfg.rollout.agent.enabled:
            from megaflow.workers.agent_hook import ReplicaAgent

            self.agent = ReplicaAgent(cfg, rank=rank, tp_group_ranks=[list(g) for g in tp_group_ranks])

    def generate(self, prompts: DataProto) -> DataProto:
        """The engine's rollout of ``prompts`` (:meth:`~megaflow.rollout.vllm_rollout.VLLMRollout.generate_sequences`),
        the ``meta_info`` seed offset by ``gen_replica x`` :data:`REPLICA_SEED_STRIDE` so that
        replicas draw distinct samples. With ``rollout.agent.enabled`` every row is a multi-turn
        trajectory (:meth:`~megaflow.workers.agent_hook.ReplicaAgent.generate`; the prompts
        then carry ``raw_prompt`` and ``extra_info``)."""
        meta = dict(prompts.meta_info)
        if meta.get("seed") is not None:
            meta["seed"] = int(meta["seed"]) + self.gen_replica * REPLICA_SEED_STRIDE
        seeded = DataProto(prompts.batch, prompts.non_tensor_batch, meta)
        if self.agent is not None:
            return self.agent.generate(self.engine, seeded)
        return self.engine.generate_sequences(seeded)

    def probe(self) -> DataProto:
        """The fixed verification probe: left-padded prompts of seeded ids (from 3 up to the
        vocabulary, generator seed 0) of :data:`PROBE_LENGTHS` tokens, greedy, seed 0."""
        lengths = [min(n, self.cfg.data.max_prompt_length) for n in PROBE_LENGTHS]
        width = max(lengths)
        gen = torch.Generator().manual_seed(0)
        ids = torch.full((len(lengths), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, n in enumerate(lengths):
            ids[i, width - n:] = torch.randint(3, self.spec.vocab_size, (n,), generator=gen)
            mask[i, width - n:] = 1
        return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, meta_info={
            "do_sample": False, "response_length": min(PROBE_RESPONSE, self.cfg.rollout.response_length),
            "seed": 0})

    def probe_rollout(self) -> DataProto:
        """The engine's greedy rollout of :meth:`probe` (no replica offset: every replica
        generates the same)."""
        return self.engine.generate_sequences(self.probe())


__all__ = ["RolloutHost", "build_engine", "returns_routed_experts", "engine_model_dir", "stop_token_ids",
           "REPLICA_SEED_STRIDE"]
