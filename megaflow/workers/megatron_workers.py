"""Megatron worker roles: actor, reference, critic and reward model.

Each rank of a role's worker group is one rank of a Megatron TP x PP x DP mesh
(:mod:`megaflow.megatron.parallel`); batch methods use ND-compute dispatch on the role's
mesh (``dp_rank`` = Megatron DP rank, collect on tp 0 / last PP stage). The workers only
plumb: batches in and out of :class:`~megaflow.megatron.engine.MegatronEngine`, PPO epochs
and mini-batches, and the thin loss adapters in :mod:`megaflow.workers.losses` over
:mod:`megaflow.algorithms`.

Outputs (``[B, R]``, DataProto field names of :mod:`megaflow.protocol`):
``compute_log_prob`` -> ``old_log_probs``, ``entropys``; ``compute_ref_log_prob`` ->
``ref_log_probs``; ``compute_values`` -> ``values``; ``compute_rm_score`` -> ``rm_scores``
(the reward model's score on the last real response token, 0 elsewhere);
``update_actor``/``update_critic`` -> the update's metrics, ``dict[str, float]`` (``actor/pg_loss``,
``critic/vf_loss``, ``actor/grad_norm``, ...; the same on every DP rank).
"""
from __future__ import annotations

from typing import Any

import torch

from megaflow.config.schema import ActorConfig, CriticConfig
from megaflow.megatron.batch import OLD_ROUTED_EXPERTS_KEY
from megaflow.megatron.engine import MegatronEngine
from megaflow.megatron.parallel import ParallelInfo, initialize_parallel, nd_dispatch_info
from megaflow.protocol import DataProto
from megaflow.single_controller import Dispatch, Worker, nd_compute, register
from megaflow.topology.role_spec import RoleSpec
from megaflow.workers import losses

#: ``model.dtype`` -> parameter and compute dtype of the Megatron model
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _tensors(data: DataProto) -> dict[str, torch.Tensor]:
    batch = data.tensors
    return {k: batch[k] for k in batch.keys() if isinstance(k, str)}  # (fields are never nested)


class MegatronWorker(Worker):
    """Common set-up of the Megatron roles (subclasses set ``config_role`` and ``default_mesh``).

    Reads the run's config through ``spec`` (``self.config`` is the whole
    :class:`~megaflow.config.schema.Config`, ``self.role_spec.section`` the role's section).

    Args:
        spec: :class:`~megaflow.topology.role_spec.RoleSpec` of the subclass's ``config_role``.
        mesh: the ND-dispatch mesh name (default: ``default_mesh``).

    Raises:
        TypeError: ``spec`` is not a RoleSpec.
        ValueError: ``spec`` is for another role than the class serves.
    """

    config_role = "actor"  # the config section this class serves
    default_mesh = "actor"
    engine: MegatronEngine  # set by init_model, like info
    info: ParallelInfo

    def __init__(self, spec: RoleSpec, mesh: str | None = None) -> None:
        super().__init__()
        if not isinstance(spec, RoleSpec):
            raise TypeError(f"spec must be a megaflow.topology.role_spec.RoleSpec, got {type(spec).__name__}")
        if spec.role != self.config_role:
            raise ValueError(f"{type(self).__name__} serves the {self.config_role!r} role, got a RoleSpec of "
                             f"{spec.role!r}")
        self.role_spec, self.config = spec, spec.config
        self.mesh = mesh or self.default_mesh

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, set up Megatron parallel state, build and load the model.

        The RNG is re-seeded with ``trainer.seed`` right before the model is built, so every
        role built from the same config draws the same random initialisation even when it
        shares its process with roles initialised before it (colocation): a randomly
        initialised reference equals the initial actor, and a critic's backbone starts as
        the actor's.

        Raises:
            RuntimeError: the process group's DP size differs from the config's (the group
                was spawned on another world size than the role's pool).
        """
        from megaflow.megatron.cpu_compat import model_parallel_manual_seed
        from megaflow.megatron.model import build_gpt_model
        from megaflow.topology.model_spec import model_spec

        spec, seed = self.role_spec, self.config.trainer.seed
        par = spec.parallel
        self.init_distributed()
        self.info = initialize_parallel(tp=par.tp, pp=par.pp, cp=par.cp, vpp=par.vpp, ep=par.ep, seed=seed)
        if self.info.dp_size != par.dp:
            raise RuntimeError(f"{spec.role}: the worker group has dp={self.info.dp_size} but the config's pool "
                               f"{par.pool!r} gives dp={par.dp} ({par.world_size} ranks / tp*pp*cp)")
        hf_config = spec.hf_config()
        model_parallel_manual_seed(seed)
        lora = getattr(spec.section, "lora", None)  # LoRA wraps the local spec's linears
        model = build_gpt_model(hf_config, head=spec.head, dtype=TORCH_DTYPES[self.config.model.dtype],
                                transformer_engine=False if lora is not None and lora.rank > 0 else None,
                                **spec.model_overrides)
        self._load_weights(model, hf_config)
        self.engine = MegatronEngine(model, self.info, spec, vocab_size=model_spec(hf_config).vocab_size)
        dp_rank, is_collect = nd_dispatch_info(self.info)
        self.register_dp_info(self.mesh, dp_rank=dp_rank, is_collect=is_collect)
        self._after_phase()

    def _load_weights(self, model, hf_config) -> None:
        from megaflow.models.weights import load_hf_weights

        path = self.role_spec.model_source.path
        if path is not None:  # otherwise the random initialisation stays
            load_hf_weights(model, path, hf_config, self.info)

    # phases: reload what was offloaded before a phase, offload after it
    def _before_phase(self, parts: tuple[str, ...] = ("params", "grads", "optimizer")) -> None:
        """Reload the offloaded ``parts`` the phase needs (forward passes and weight syncs:
        parameters only)."""
        if self.engine.offloaded:
            self.engine.reload(parts)

    def _after_phase(self) -> None:
        parts = self.role_spec.offload
        if any(parts.values()):
            self.engine.offload(**parts)

    def _forward(self, data: DataProto, **kwargs) -> dict[str, torch.Tensor] | None:
        self._before_phase(("params",))
        try:
            return self.engine.forward(_tensors(data), **kwargs)
        finally:
            self._after_phase()

    def _sampling(self, data: DataProto) -> dict[str, Any]:
        """``temperature``, ``top_p``, ``top_k`` of the actor's log-probs: the rollout's (``meta_info``
        overrides the config); truncation only with ``rollout.logprobs_mode="processed"``."""
        r, meta = self.config.rollout, data.meta_info
        processed = r.logprobs_mode == "processed"
        return {"temperature": float(meta.get("temperature", r.temperature)),
                "top_p": float(meta.get("top_p", r.top_p)) if processed else 1.0,
                "top_k": int(meta.get("top_k", r.top_k)) if processed else -1}

    def _update(self, data: DataProto, loss_fn, **kwargs) -> dict[str, float]:
        """PPO epochs x mini-batches over this rank's rows; one optimizer step each.

        The rows are validated and left-aligned once; each mini-batch takes its rows of
        that alignment (:meth:`~megaflow.megatron.batch.LeftAlignedBatch.take`).

        Returns the per-step engine metrics averaged over the steps (:func:`losses.mean_metrics`;
        DP-reduced by the engine, so every rank of the last stage returns the same values)."""
        rows = len(data)
        per_rank = self.role_spec.mini_batch_size_per_dp_rank
        steps = []
        self._before_phase()
        try:
            aligned = self.engine.left_align(_tensors(data))
            for epoch in range(self._trained_section().ppo_epochs):
                order = self._mini_batch_order(rows, per_rank, epoch)
                for start in range(0, rows, per_rank):
                    index = torch.arange(start, min(start + per_rank, rows)) if order is None \
                        else order[start:start + per_rank]
                    steps.append(self.engine.train_step(aligned.take(index), loss_fn, **kwargs))
        finally:
            self._after_phase()
        return losses.mean_metrics(steps, self.role_spec.role)

    def _trained_section(self) -> ActorConfig | CriticConfig:
        """The role's section, for the roles that train (the update's callers)."""
        section = self.role_spec.section
        if not isinstance(section, ActorConfig | CriticConfig):
            raise RuntimeError(f"role {self.role_spec.role!r} does not train")
        return section

    def _mini_batch_order(self, rows: int, per_rank: int, epoch: int) -> torch.Tensor | None:
        """Row order of one PPO epoch ``[rows]`` (int64) with ``actor.shuffle``; None: in order.

        The permutation is drawn from a generator seeded by (``trainer.seed``, the number of
        optimizer steps taken so far, ``epoch``, DP rank), so it is reproducible across a
        checkpoint resume (the step count is part of the saved LR schedule) and independent
        of the global RNG streams. With one mini-batch the order cannot change the update
        (the mini-batch holds the same rows), so it stays the identity.
        """
        if not self.role_spec.shuffle or rows <= per_rank:
            return None
        scheduler = self.engine.scheduler
        if scheduler is None:  # (the trained roles have one)
            raise RuntimeError(f"role {self.role_spec.role!r} has no LR schedule to seed its mini-batch order from")
        steps = int(scheduler.num_steps)
        seed = ((self.config.trainer.seed * 1_000_003 + steps) * 1_009 + epoch) * 1_013 + self.info.dp_rank
        generator = torch.Generator().manual_seed(seed % 2**63)
        return torch.randperm(rows, generator=generator)

    # checkpoints (collective: every rank of the group)
    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Model (megatron-core distributed checkpoint), optimizer and LR schedule to ``path``."""
        from megaflow.workers.checkpointing import save_engine_checkpoint

        self._before_phase()
        save_engine_checkpoint(self.engine, path, self.role_spec.hf_config(),
                               hf_files_from=self.role_spec.model_source.path)

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str, overwrite: bool = False) -> None:
        """Write the model as a Hugging Face checkpoint directory at ``path`` (collective;
        safetensors + config, tokenizer files copied from ``model_path`` when there is one).
        With ``<role>.lora.rank > 0``: the frozen base there and the adapters in PEFT layout
        in ``path/adapter`` (:func:`megaflow.models.export.export_hf_dir`)."""
        from megaflow.models.export import export_hf_dir

        self._before_phase()
        try:
            lora = getattr(self.role_spec.section, "lora", None)
            export_hf_dir(self.engine.module, self.role_spec.hf_config(), self.info, path,
                          hf_files_from=self.role_spec.model_source.path, overwrite=overwrite,
                          adapter=self._peft_adapter(), adapter_dropout=lora.dropout if lora is not None else 0.0)
        finally:
            self._after_phase()

    def _peft_adapter(self) -> Any:
        """The model's LoRA adapters in PEFT layout on every rank (collective over TP and PP;
        :func:`megaflow.rollout.lora_sync.gather_adapter_pieces`), or None without LoRA."""
        from megaflow.megatron.lora import has_lora

        lora = getattr(self.role_spec.section, "lora", None)
        if lora is None or not has_lora(self.engine.module):
            return None
        from megaflow.models.hf_mapping import ModelSpec
        from megaflow.models.peft_io import megatron_to_peft
        from megaflow.models.transforms import kv_replication_factor
        from megaflow.rollout.lora_sync import gather_adapter_pieces, local_adapter_tensors

        pieces = gather_adapter_pieces(local_adapter_tensors(self.engine.module), tp_group=self.info.tp_group,
                                       pp_group=self.info.pp_group)
        spec = ModelSpec.from_hf_config(self.role_spec.hf_config())
        replication = kv_replication_factor(spec.num_kv_heads, spec.num_heads, self.info.tp_size)
        return megatron_to_peft(pieces, spec, alpha=lora.alpha, kv_replication=replication)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (model, optimizer, LR schedule)."""
        from megaflow.workers.checkpointing import load_engine_checkpoint

        self._before_phase()
        load_engine_checkpoint(self.engine, path)
        self._after_phase()


class ActorWorker(MegatronWorker):
    """The policy: old log-probs (+ entropy) and PPO/GSPO updates on the ``actor`` mesh."""

    config_role, default_mesh = "actor", "actor"

    @register(nd_compute("actor"))
    def compute_log_prob(self, data: DataProto) -> DataProto | None:
        """``old_log_probs`` and ``entropys`` ``[B, R]`` at the rollout temperature (+ the
        router's ``old_routed_experts`` of a MoE actor that records them, see
        :meth:`~megaflow.megatron.engine.MegatronEngine.forward`'s ``record_routing``)."""
        out = self._forward(data, **self._sampling(data), with_entropy=True, record_routing=True)
        if out is None:
            return None
        routing = {k: v for k, v in out.items() if k == OLD_ROUTED_EXPERTS_KEY}
        return DataProto.from_dict({"old_log_probs": out["log_probs"], "entropys": out["entropy"], **routing})

    @register(nd_compute("actor"))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        """``ref_log_probs`` ``[B, R]`` at the rollout temperature from the actor's frozen base
        (``actor.lora.rank > 0``: adapters disabled, :func:`megaflow.megatron.lora.adapters_disabled`),
        the reference policy without a reference group.

        Raises:
            RuntimeError: the actor has no LoRA adapters (its weights are not the reference's).
        """
        from megaflow.megatron.lora import adapters_disabled, has_lora

        if not has_lora(self.engine.module):
            raise RuntimeError("compute_ref_log_prob on the actor needs actor.lora.rank > 0 (its frozen base is "
                               "the reference); without LoRA the reference group computes them")
        with adapters_disabled(self.engine.module):
            out = self._forward(data, **self._sampling(data))
        return None if out is None else DataProto.from_dict({"ref_log_probs": out["log_probs"]})

    @register(nd_compute("actor"))
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO epochs over mini-batches (returns the update's metrics); needs ``old_log_probs``, ``advantages``,
        ``response_mask`` (+ ``ref_log_probs`` with ``use_kl_loss``; no ``old_log_probs`` with
        ``actor.on_policy_old_log_probs``, see :func:`megaflow.workers.losses.actor_loss_fn`)."""
        loss_fn = losses.actor_loss_fn(self.config)
        return self._update(data, loss_fn, **self._sampling(data),
                            with_entropy=losses.needs_entropy(self.config))


class RefWorker(MegatronWorker):
    """The frozen reference policy on the ``ref`` mesh (no optimizer)."""

    config_role, default_mesh = "ref", "ref"

    @register(nd_compute("ref"))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        """``ref_log_probs`` ``[B, R]`` at the rollout temperature."""
        out = self._forward(data, **self._sampling(data))
        return None if out is None else DataProto.from_dict({"ref_log_probs": out["log_probs"]})


class CriticWorker(MegatronWorker):
    """The value model on the ``critic`` mesh."""

    config_role, default_mesh = "critic", "critic"

    @register(nd_compute("critic"))
    def compute_values(self, data: DataProto) -> DataProto | None:
        """``values`` ``[B, R]``: V of the state before each response token."""
        out = self._forward(data)
        return None if out is None else DataProto.from_dict({"values": out["values"]})

    @register(nd_compute("critic"))
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Clipped value regression on ``returns`` (returns the update's metrics); needs ``values`` (old), ``returns``,
        ``response_mask``."""
        return self._update(data, losses.critic_loss_fn(self.config))


class CostCriticWorker(CriticWorker):
    """Safe RLHF's cost value model on the ``cost_critic`` mesh: the critic's class and
    settings (the ``critic`` section), fitted to the cost's GAE returns
    (:mod:`megaflow.algorithms.safe_rlhf`). The controller sends the cost's values and returns
    under the critic's field names (``values``, ``returns``)."""

    config_role, default_mesh = "cost_critic", "cost_critic"

    @register(nd_compute("cost_critic"))
    def compute_values(self, data: DataProto) -> DataProto | None:
        """``values`` ``[B, R]``: the expected cost-to-go before each response token."""
        return CriticWorker.compute_values(self, data)

    @register(nd_compute("cost_critic"))
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Clipped value regression on the cost's ``returns`` (metrics ``critic/...``, which the
        controller renames ``cost_critic/...``); needs ``values``, ``returns``, ``response_mask``."""
        return CriticWorker.update_critic(self, data)


class RewardModelWorker(MegatronWorker):
    """A scalar-head reward model on the ``reward_model`` mesh (no optimizer)."""

    config_role, default_mesh = "reward_model", "reward_model"

    @register(nd_compute("reward_model"))
    def compute_rm_score(self, data: DataProto) -> DataProto | None:
        """``rm_scores`` ``[B, R]``: the score on the last real response token, 0 elsewhere."""
        out = self._forward(data)
        if out is None:
            return None
        resp_len = data.tensors["responses"].shape[1]
        real = data.tensors["attention_mask"][:, -resp_len:].cpu() != 0
        last = (real.cumsum(-1) == real.sum(-1, keepdim=True)) & real
        return DataProto.from_dict({"rm_scores": out["scores"] * last})


__all__ = ["MegatronWorker", "ActorWorker", "RefWorker", "CriticWorker", "CostCriticWorker", "RewardModelWorker"]
