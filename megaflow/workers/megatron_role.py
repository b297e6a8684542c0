"""One Megatron role's model in a worker process: its engine, its offload state and its phases.

A :class:`MegatronRole` is what every Megatron worker holds (the actor, reference, critic,
cost critic and reward model of :mod:`megaflow.workers.megatron_workers`, the actors of
:mod:`megaflow.workers.actor_rollout` and :mod:`megaflow.workers.rollout_worker`): it builds
the rank's model on its TP x PP x DP mesh, wraps it in a
:class:`~megaflow.megatron.engine.MegatronEngine`, and runs every use of it inside one
:meth:`MegatronRole.phase`: the parts the phase needs are reloaded onto the device first and
the parts ``<role>.param_offload`` / ``grad_offload`` / ``optimizer_offload`` name go back
off it afterwards. On top of that it holds what all roles do with the engine: a forward
pass, the PPO update loop (epochs x mini-batches), checkpoints and the Hugging Face export.
The workers only add their registered methods and the role-specific outputs.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch

from megaflow.config.schema import ActorConfig, CriticConfig
from megaflow.megatron.parallel import ParallelInfo, initialize_parallel, nd_dispatch_info
from megaflow.protocol import DataProto
from megaflow.topology.role_spec import RoleSpec
from megaflow.workers import losses

if TYPE_CHECKING:
    from megaflow.megatron.engine import MegatronEngine
    from megaflow.single_controller import Worker

#: ``model.dtype`` -> parameter and compute dtype of the Megatron model
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The parts of the engine state a phase can need on the device (a training phase needs all)
ALL_PARTS = ("params", "grads", "optimizer")


def batch_tensors(data: DataProto) -> dict[str, torch.Tensor]:
    """The tensor fields of ``data`` by name (a DataProto's fields are never nested)."""
    batch = data.tensors
    return {k: batch[k] for k in batch.keys() if isinstance(k, str)}


class MegatronRole:
    """The model of one role on this rank: built by :meth:`build`, used inside :meth:`phase`.

    Args:
        spec: the role's :class:`~megaflow.topology.role_spec.RoleSpec` (``spec.section`` is
            the role's config section, ``spec.config`` the whole config).

    Attributes:
        engine: the :class:`~megaflow.megatron.engine.MegatronEngine` (set by :meth:`build`).
        info: this rank's :class:`~megaflow.megatron.parallel.ParallelInfo` (set by :meth:`build`).
    """

    engine: MegatronEngine
    info: ParallelInfo

    def __init__(self, spec: RoleSpec) -> None:
        self.spec, self.config = spec, spec.config

    def build(self, worker: Worker, mesh: str) -> None:
        """Join the worker group's process group, set up Megatron parallel state, build and
        load the model, register the rank's place in ``mesh`` and offload per the config.

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
        from megaflow.megatron.engine import MegatronEngine
        from megaflow.megatron.model import build_gpt_model
        from megaflow.topology.model_spec import model_spec

        spec, seed = self.spec, self.config.trainer.seed
        par = spec.parallel
        worker.init_distributed()
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
        worker.register_dp_info(mesh, dp_rank=dp_rank, is_collect=is_collect)
        self._offload()

    def _load_weights(self, model: Any, hf_config: Any) -> None:
        from megaflow.models.weights import load_hf_weights

        path = self.spec.model_source.path
        if path is not None:  # otherwise the random initialisation stays
            load_hf_weights(model, path, hf_config, self.info)

    # ------------------------------------------------------------------ phases
    @contextmanager
    def phase(self, parts: tuple[str, ...] = ALL_PARTS) -> Iterator[MegatronEngine]:
        """One use of the engine: reload the offloaded ``parts`` it needs (forward passes and
        weight syncs: ``("params",)``; updates and checkpoints: all), yield the engine, and
        offload what ``<role>.param_offload`` / ``grad_offload`` / ``optimizer_offload`` name
        afterwards, also when the phase raised (the next phase reloads what it needs)."""
        if self.engine.offloaded:
            self.engine.reload(parts)
        try:
            yield self.engine
        finally:
            self._offload()

    def _offload(self) -> None:
        parts = self.spec.offload
        if any(parts.values()):
            self.engine.offload(**parts)

    def forward(self, data: DataProto, **kwargs: Any) -> dict[str, torch.Tensor] | None:
        """The engine's forward pass over ``data``'s rows in a parameters-only phase
        (:meth:`~megaflow.megatron.engine.MegatronEngine.forward`; ``[B, R]`` outputs, None off
        the last pipeline stage)."""
        with self.phase(("params",)) as engine:
            return engine.forward(batch_tensors(data), **kwargs)

    # ------------------------------------------------------------------ the update
    def update(self, data: DataProto, loss_fn: Callable[..., Any], **kwargs: Any) -> dict[str, float]:
        """PPO epochs x mini-batches over this rank's rows; one optimizer step each.

        The rows are validated and left-aligned once; each mini-batch takes its rows of
        that alignment (:meth:`~megaflow.megatron.batch.LeftAlignedBatch.take`).

        Returns the per-step engine metrics averaged over the steps (:func:`losses.mean_metrics`;
        DP-reduced by the engine, so every rank of the last stage returns the same values).

        Raises:
            RuntimeError: the role does not train (its section is not ``actor`` or ``critic``).
        """
        rows = len(data)
        per_rank = self.spec.mini_batch_size_per_dp_rank
        epochs = self.trained_section().ppo_epochs
        steps = []
        with self.phase() as engine:
            aligned = engine.left_align(batch_tensors(data))
            for epoch in range(epochs):
                order = self.mini_batch_order(rows, per_rank, epoch)
                for start in range(0, rows, per_rank):
                    index = torch.arange(start, min(start + per_rank, rows)) if order is None \
                        else order[start:start + per_rank]
                    steps.append(engine.train_step(aligned.take(index), loss_fn, **kwargs))
        return losses.mean_metrics(steps, self.spec.role)

    def trained_section(self) -> ActorConfig | CriticConfig:
        """The role's section, for the roles that train (the update's callers).

        Raises:
            RuntimeError: the role does not train.
        """
        section = self.spec.section
        if not isinstance(section, ActorConfig | CriticConfig):
            raise RuntimeError(f"role {self.spec.role!r} does not train")
        return section

    def mini_batch_order(self, rows: int, per_rank: int, epoch: int) -> torch.Tensor | None:
        """Row order of one PPO epoch ``[rows]`` (int64) with ``actor.shuffle``; None: in order.

        The permutation is drawn from a generator seeded by (``trainer.seed``, the number of
        optimizer steps taken so far, ``epoch``, DP rank), so it is reproducible across a
        checkpoint resume (the step count is part of the saved LR schedule) and independent
        of the global RNG streams. With one mini-batch the order cannot change the update
        (the mini-batch holds the same rows), so it stays the identity.

        Raises:
            RuntimeError: shuffling a role without an LR schedule.
        """
        if not self.spec.shuffle or rows <= per_rank:
            return None
        scheduler = self.engine.scheduler
        if scheduler is None:  # (the trained roles have one)
            raise RuntimeError(f"role {self.spec.role!r} has no LR schedule to seed its mini-batch order from")
        steps = int(scheduler.num_steps)
        seed = ((self.config.trainer.seed * 1_000_003 + steps) * 1_009 + epoch) * 1_013 + self.info.dp_rank
        generator = torch.Generator().manual_seed(seed % 2**63)
        return torch.randperm(rows, generator=generator)

    # ------------------------------------------------------------------ checkpoints (collective)
    def save_checkpoint(self, path: str) -> None:
        """Model (megatron-core distributed checkpoint), optimizer and LR schedule to ``path``."""
        from megaflow.workers.checkpointing import save_engine_checkpoint

        with self.phase() as engine:
            save_engine_checkpoint(engine, path, self.spec.hf_config(), hf_files_from=self.spec.model_source.path)

    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (model, optimizer, LR schedule)."""
        from megaflow.workers.checkpointing import load_engine_checkpoint

        with self.phase() as engine:
            load_engine_checkpoint(engine, path)

    def export_hf(self, path: str, overwrite: bool = False) -> None:
        """Write the model as a Hugging Face checkpoint directory at ``path`` (collective;
        safetensors + config, tokenizer files copied from ``model_path`` when there is one).
        With ``<role>.lora.rank > 0``: the frozen base there and the adapters in PEFT layout
        in ``path/adapter`` (:func:`megaflow.models.export.export_hf_dir`)."""
        from megaflow.models.export import export_hf_dir

        with self.phase() as engine:
            lora = getattr(self.spec.section, "lora", None)
            export_hf_dir(engine.module, self.spec.hf_config(), self.info, path,
                          hf_files_from=self.spec.model_source.path, overwrite=overwrite,
                          adapter=self.peft_adapter(), adapter_dropout=lora.dropout if lora is not None else 0.0)

    def peft_adapter(self) -> Any:
        """The model's LoRA adapters in PEFT layout on every rank (collective over TP and PP;
        :func:`megaflow.rollout.lora_sync.gather_adapter_pieces`), or None without LoRA."""
        from megaflow.megatron.lora import has_lora

        lora = getattr(self.spec.section, "lora", None)
        if lora is None or not has_lora(self.engine.module):
            return None
        from megaflow.models.hf_mapping import ModelSpec
        from megaflow.models.peft_io import megatron_to_peft
        from megaflow.models.transforms import kv_replication_factor
        from megaflow.rollout.lora_sync import gather_adapter_pieces, local_adapter_tensors

        pieces = gather_adapter_pieces(local_adapter_tensors(self.engine.module), tp_group=self.info.tp_group,
                                       pp_group=self.info.pp_group)
        spec = ModelSpec.from_hf_config(self.spec.hf_config())
        replication = kv_replication_factor(spec.num_kv_heads, spec.num_heads, self.info.tp_size)
        return megatron_to_peft(pieces, spec, alpha=lora.alpha, kv_replication=replication)


__all__ = ["MegatronRole", "TORCH_DTYPES", "ALL_PARTS", "batch_tensors"]
