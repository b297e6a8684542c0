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
``update_actor``/``update_critic`` -> a row-less DataProto with ``meta_info["metrics"]``.
"""
from __future__ import annotations

from typing import Optional

import torch

from megaflow.megatron.engine import MegatronEngine
from megaflow.megatron.parallel import ParallelInfo, initialize_parallel, nd_dispatch_info
from megaflow.protocol import DataProto
from megaflow.single_controller import Dispatch, Worker, nd_compute, register
from megaflow.workers import losses
from megaflow.workers.config import MegatronWorkerConfig


def _tensors(data: DataProto) -> dict[str, torch.Tensor]:
    return {k: data.batch[k] for k in data.batch.keys()}


class MegatronWorker(Worker):
    """Common set-up of the Megatron roles (subclasses set ``role``/``mesh``/``trains``).

    Args:
        config: :class:`~megaflow.workers.config.MegatronWorkerConfig`.
        mesh: the ND-dispatch mesh name (default: the role name).
    """

    role = "actor"  # model head: actor (LM head), critic / reward (scalar head)
    default_mesh = "actor"
    trains = True

    def __init__(self, config: MegatronWorkerConfig, mesh: Optional[str] = None) -> None:
        super().__init__()
        if not isinstance(config, MegatronWorkerConfig):
            raise TypeError(f"config must be a MegatronWorkerConfig, got {type(config).__name__}")
        self.config = config
        self.mesh = mesh or self.default_mesh
        self.engine: Optional[MegatronEngine] = None
        self.info: Optional[ParallelInfo] = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, set up Megatron parallel state, build and load the model.

        The RNG is re-seeded with ``config.seed`` right before the model is built, so every
        role built from the same config draws the same random initialisation even when it
        shares its process with roles initialised before it (colocation): a randomly
        initialised reference equals the initial actor, and a critic's backbone starts as
        the actor's.
        """
        from megaflow.megatron.cpu_compat import model_parallel_manual_seed
        from megaflow.megatron.model import build_gpt_model, read_hf_architecture

        cfg = self.config
        self.init_distributed()
        self.info = initialize_parallel(tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, vpp=cfg.vpp, seed=cfg.seed)
        hf_config = cfg.resolve_hf_config()
        model_parallel_manual_seed(cfg.seed)
        model = build_gpt_model(hf_config, role=self.role, dtype=cfg.torch_dtype, **cfg.model_overrides)
        self._load_weights(model, hf_config)
        self.engine = MegatronEngine(model, self.info, cfg.engine,
                                     vocab_size=read_hf_architecture(hf_config).vocab_size,
                                     role=self.role, train=self.trains)
        dp_rank, is_collect = nd_dispatch_info(self.info)
        self.register_dp_info(self.mesh, dp_rank=dp_rank, is_collect=is_collect)
        self._after_phase()

    def _load_weights(self, model, hf_config) -> None:
        from megaflow.models.checkpoint import load_checkpoint
        from megaflow.models.weights import load_hf_weights

        if self.config.checkpoint:
            load_checkpoint(model, self.config.checkpoint)
        elif self.config.model_path:
            load_hf_weights(model, self.config.model_path, hf_config, self.info)

    # phases: reload what was offloaded before a phase, offload after it
    def _before_phase(self, parts: tuple[str, ...] = ("params", "grads", "optimizer")) -> None:
        """Reload the offloaded ``parts`` the phase needs (forward passes and weight syncs:
        parameters only)."""
        if self.engine.offloaded:
            self.engine.reload(parts)

    def _after_phase(self) -> None:
        cfg = self.config
        if cfg.param_offload or cfg.grad_offload or cfg.optimizer_offload:
            self.engine.offload(params=cfg.param_offload, grads=cfg.grad_offload, optimizer=cfg.optimizer_offload)

    def _forward(self, data: DataProto, **kwargs) -> Optional[dict[str, torch.Tensor]]:
        self._before_phase(("params",))
        try:
            return self.engine.forward(_tensors(data), **kwargs)
        finally:
            self._after_phase()

    def _temperature(self, data: DataProto) -> float:
        return float(data.meta_info.get("temperature", self.config.temperature))

    def _update(self, data: DataProto, loss_fn, **kwargs) -> DataProto:
        """PPO epochs x mini-batches over this rank's rows; one optimizer step each."""
        cfg = self.config
        rows = len(data)
        per_rank = cfg.mini_batch_rows_per_rank(self.info.dp_size, rows)
        tensors = _tensors(data)
        steps = []
        self._before_phase()
        try:
            for epoch in range(cfg.ppo_epochs):
                order = self._mini_batch_order(rows, per_rank, epoch)
                for start in range(0, rows, per_rank):
                    index = slice(start, start + per_rank) if order is None else order[start:start + per_rank]
                    mini = {k: v[index] for k, v in tensors.items()}
                    steps.append(self.engine.train_step(mini, loss_fn, **kwargs))
        finally:
            self._after_phase()
        return DataProto.from_dict(meta_info={"metrics": losses.mean_metrics(steps, self.role)})

    def _mini_batch_order(self, rows: int, per_rank: int, epoch: int) -> Optional[torch.Tensor]:
        """Row order of one PPO epoch ``[rows]`` (int64) with ``config.shuffle``; None: in order.

        The permutation is drawn from a generator seeded by (``config.seed``, the number of
        optimizer steps taken so far, ``epoch``, DP rank), so it is reproducible across a
        checkpoint resume (the step count is part of the saved LR schedule) and independent
        of the global RNG streams. With one mini-batch the order cannot change the update
        (the mini-batch holds the same rows), so it stays the identity.
        """
        if not self.config.shuffle or rows <= per_rank:
            return None
        steps = int(self.engine.scheduler.num_steps)
        seed = ((self.config.seed * 1_000_003 + steps) * 1_009 + epoch) * 1_013 + self.info.dp_rank
        generator = torch.Generator().manual_seed(seed % 2**63)
        return torch.randperm(rows, generator=generator)

    # checkpoints (collective: every rank of the group)
    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Model (megatron-core distributed checkpoint), optimizer and LR schedule to ``path``."""
        from megaflow.workers.checkpointing import save_engine_checkpoint

        self._before_phase()
        save_engine_checkpoint(self.engine, path, self.config.resolve_hf_config(),
                               hf_files_from=self.config.model_path)

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str, overwrite: bool = False) -> None:
        """Write the model as a Hugging Face checkpoint directory at ``path`` (collective;
        safetensors + config, tokenizer files copied from ``model_path`` when there is one)."""
        from megaflow.models.export import export_hf_dir

        self._before_phase()
        try:
            export_hf_dir(self.engine.module, self.config.resolve_hf_config(), self.info, path,
                          hf_files_from=self.config.model_path, overwrite=overwrite)
        finally:
            self._after_phase()

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (model, optimizer, LR schedule)."""
        from megaflow.workers.checkpointing import load_engine_checkpoint

        self._before_phase()
        load_engine_checkpoint(self.engine, path)
        self._after_phase()


class ActorWorker(MegatronWorker):
    """The policy: old log-probs (+ entropy) and PPO/GSPO updates on the ``actor`` mesh."""

    role, default_mesh, trains = "actor", "actor", True

    @register(nd_compute("actor"))
    def compute_log_prob(self, data: DataProto) -> Optional[DataProto]:
        """``old_log_probs`` and ``entropys`` ``[B, R]`` at the rollout temperature."""
        out = self._forward(data, temperature=self._temperature(data), with_entropy=True)
        if out is None:
            return None
        return DataProto.from_dict({"old_log_probs": out["log_probs"], "entropys": out["entropy"]})

    @register(nd_compute("actor"))
    def update_actor(self, data: DataProto) -> DataProto:
        """PPO epochs over mini-batches; needs ``old_log_probs``, ``advantages``,
        ``response_mask`` (+ ``ref_log_probs`` with ``use_kl_loss``)."""
        loss_fn = losses.actor_loss_fn(self.config.actor)
        return self._update(data, loss_fn, temperature=self._temperature(data),
                            with_entropy=self.config.actor.needs_entropy)


class RefWorker(MegatronWorker):
    """The frozen reference policy on the ``ref`` mesh (no optimizer)."""

    role, default_mesh, trains = "actor", "ref", False

    @register(nd_compute("ref"))
    def compute_ref_log_prob(self, data: DataProto) -> Optional[DataProto]:
        """``ref_log_probs`` ``[B, R]`` at the rollout temperature."""
        out = self._forward(data, temperature=self._temperature(data))
        return None if out is None else DataProto.from_dict({"ref_log_probs": out["log_probs"]})


class CriticWorker(MegatronWorker):
    """The value model on the ``critic`` mesh."""

    role, default_mesh, trains = "critic", "critic", True

    @register(nd_compute("critic"))
    def compute_values(self, data: DataProto) -> Optional[DataProto]:
        """``values`` ``[B, R]``: V of the state before each response token."""
        out = self._forward(data)
        return None if out is None else DataProto.from_dict({"values": out["values"]})

    @register(nd_compute("critic"))
    def update_critic(self, data: DataProto) -> DataProto:
        """Clipped value regression on ``returns``; needs ``values`` (old), ``returns``,
        ``response_mask``."""
        return self._update(data, losses.critic_loss_fn(self.config.critic))


class RewardModelWorker(MegatronWorker):
    """A scalar-head reward model on the ``reward_model`` mesh (no optimizer)."""

    role, default_mesh, trains = "reward", "reward_model", False

    @register(nd_compute("reward_model"))
    def compute_rm_score(self, data: DataProto) -> Optional[DataProto]:
        """``rm_scores`` ``[B, R]``: the score on the last real response token, 0 elsewhere."""
        out = self._forward(data)
        if out is None:
            return None
        resp_len = data.batch["responses"].shape[1]
        real = data.batch["attention_mask"][:, -resp_len:].cpu() != 0
        last = (real.cumsum(-1) == real.sum(-1, keepdim=True)) & real
        return DataProto.from_dict({"rm_scores": out["scores"] * last})


__all__ = ["MegatronWorker", "ActorWorker", "RefWorker", "CriticWorker", "RewardModelWorker"]
