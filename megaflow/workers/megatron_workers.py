"""Megatron worker roles: actor, reference, critic, cost critic and reward model.

Each rank of a role's worker group is one rank of a Megatron TP x PP x DP mesh
(:mod:`megaflow.megatron.parallel`); batch methods use ND-compute dispatch on the role's
mesh (``dp_rank`` = Megatron DP rank, collect on tp 0 / last PP stage). Every worker class
is one level below :class:`MegatronWorker` and holds the rank's model as a
:class:`~megaflow.workers.megatron_role.MegatronRole` (engine, offload, phases, the update
loop, checkpoints): the workers only name their registered methods and shape the outputs,
with the loss adapters of :mod:`megaflow.workers.losses` over :mod:`megaflow.algorithms`.
The policy and value computations shared by several workers are the plain functions below.

Outputs (``[B, R]``, DataProto field names of :mod:`megaflow.protocol`):
``compute_log_prob`` -> ``old_log_probs``, ``entropys``; ``compute_ref_log_prob`` ->
``ref_log_probs``; ``compute_values`` -> ``values``; ``compute_rm_score`` -> ``rm_scores``
(the reward model's score on the last real response token, 0 elsewhere);
``update_actor``/``update_critic`` -> the update's metrics, ``dict[str, float]`` (``actor/pg_loss``,
``critic/vf_loss``, ``actor/grad_norm``, ...; the same on every DP rank).
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from megaflow.config.schema import Config
from megaflow.megatron.batch import OLD_ROUTED_EXPERTS_KEY
from megaflow.protocol import DataProto
from megaflow.single_controller import Dispatch, Worker, nd_compute, register
from megaflow.topology.role_spec import RoleSpec
from megaflow.workers import losses
from megaflow.workers.megatron_role import TORCH_DTYPES, MegatronRole


def rollout_sampling(cfg: Config, meta: Mapping[str, Any]) -> dict[str, Any]:
    """``temperature``, ``top_p``, ``top_k`` of the policy's log-probs: the rollout's (a call's
    ``meta`` overrides ``rollout.*``); truncation only with ``rollout.logprobs_mode="processed"``."""
    r = cfg.rollout
    processed = r.logprobs_mode == "processed"
    return {"temperature": float(meta.get("temperature", r.temperature)),
            "top_p": float(meta.get("top_p", r.top_p)) if processed else 1.0,
            "top_k": int(meta.get("top_k", r.top_k)) if processed else -1}


def policy_log_probs(role: MegatronRole, data: DataProto) -> DataProto | None:
    """``old_log_probs`` and ``entropys`` ``[B, R]`` of the policy at the rollout temperature
    (None off the collect ranks), plus the router's ``old_routed_experts`` of a MoE actor that
    records them (``actor.router_replay=R2``, see
    :meth:`~megaflow.megatron.engine.MegatronEngine.forward`'s ``record_routing``)."""
    out = role.forward(data, **rollout_sampling(role.config, data.meta_info), with_entropy=True,
                       record_routing=True)
    if out is None:
        return None
    routing = {k: v for k, v in out.items() if k == OLD_ROUTED_EXPERTS_KEY}
    return DataProto.from_dict({"old_log_probs": out["log_probs"], "entropys": out["entropy"], **routing})


def reference_log_probs(role: MegatronRole, data: DataProto) -> DataProto | None:
    """``ref_log_probs`` ``[B, R]`` of ``role``'s model as it is at the rollout temperature
    (None off the collect ranks)."""
    out = role.forward(data, **rollout_sampling(role.config, data.meta_info))
    return None if out is None else DataProto.from_dict({"ref_log_probs": out["log_probs"]})


def frozen_base_log_probs(role: MegatronRole, data: DataProto) -> DataProto | None:
    """``ref_log_probs`` ``[B, R]`` of the LoRA actor's frozen base (adapters disabled,
    :func:`megaflow.megatron.lora.adapters_disabled`): the reference policy without a
    reference group.

    Raises:
        RuntimeError: the model has no LoRA adapters (its weights are not the reference's).
    """
    from megaflow.megatron.lora import adapters_disabled, has_lora

    if not has_lora(role.engine.module):
        raise RuntimeError("compute_ref_log_prob on the actor needs actor.lora.rank > 0 (its frozen base is "
                           "the reference); without LoRA the reference group computes them")
    with adapters_disabled(role.engine.module):
        return reference_log_probs(role, data)


def policy_update(role: MegatronRole, data: DataProto) -> dict[str, float]:
    """The PPO/GSPO update of the policy (:meth:`MegatronRole.update` with
    :func:`megaflow.workers.losses.actor_loss_fn`); returns the update's metrics."""
    cfg = role.config
    return role.update(data, losses.actor_loss_fn(cfg), **rollout_sampling(cfg, data.meta_info),
                       with_entropy=losses.needs_entropy(cfg))


def value_estimates(role: MegatronRole, data: DataProto) -> DataProto | None:
    """``values`` ``[B, R]`` of a value model: V of the state before each response token."""
    out = role.forward(data)
    return None if out is None else DataProto.from_dict({"values": out["values"]})


def value_update(role: MegatronRole, data: DataProto) -> dict[str, float]:
    """Clipped value regression on ``returns`` (:func:`megaflow.workers.losses.critic_loss_fn`);
    returns the update's metrics (``critic/...``)."""
    return role.update(data, losses.critic_loss_fn(role.config))


class MegatronWorker(Worker):
    """A Megatron role's worker: it holds the rank's :class:`~megaflow.workers.megatron_role.MegatronRole`
    and serves the methods every Megatron role has (build, checkpoints, export). Subclasses set
    ``config_role`` and ``default_mesh`` and add their role's methods; none goes deeper.

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

    def __init__(self, spec: RoleSpec, mesh: str | None = None) -> None:
        super().__init__()
        if not isinstance(spec, RoleSpec):
            raise TypeError(f"spec must be a megaflow.topology.role_spec.RoleSpec, got {type(spec).__name__}")
        if spec.role != self.config_role:
            raise ValueError(f"{type(self).__name__} serves the {self.config_role!r} role, got a RoleSpec of "
                             f"{spec.role!r}")
        self.role_spec, self.config = spec, spec.config
        self.mesh = mesh or self.default_mesh
        self.role = MegatronRole(spec)

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Join the process group, set up Megatron parallel state, build and load the model
        (:meth:`~megaflow.workers.megatron_role.MegatronRole.build`)."""
        self.role.build(self, self.mesh)

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """Model (megatron-core distributed checkpoint), optimizer and LR schedule to ``path``."""
        self.role.save_checkpoint(path)

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, path: str, overwrite: bool = False) -> None:
        """Write the model as a Hugging Face checkpoint directory at ``path``
        (:meth:`~megaflow.workers.megatron_role.MegatronRole.export_hf`; collective)."""
        self.role.export_hf(path, overwrite)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        """Restore what :meth:`save_checkpoint` wrote (model, optimizer, LR schedule)."""
        self.role.load_checkpoint(path)


class ActorWorker(MegatronWorker):
    """The policy alone: old log-probs (+ entropy) and PPO/GSPO updates on the ``actor`` mesh
    (the actor of a run is :class:`~megaflow.workers.actor_rollout.ActorRolloutWorker`, with its
    rollout engine)."""

    config_role, default_mesh = "actor", "actor"

    @register(nd_compute("actor"))
    def compute_log_prob(self, data: DataProto) -> DataProto | None:
        """``old_log_probs`` and ``entropys`` ``[B, R]`` at the rollout temperature."""
        return policy_log_probs(self.role, data)

    @register(nd_compute("actor"))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        """``ref_log_probs`` ``[B, R]`` of the frozen base (``actor.lora.rank > 0``; see
        :func:`frozen_base_log_probs`, which raises RuntimeError without LoRA)."""
        return frozen_base_log_probs(self.role, data)

    @register(nd_compute("actor"))
    def update_actor(self, data: DataProto) -> dict[str, float]:
        """PPO epochs over mini-batches (returns the update's metrics); needs ``old_log_probs``, ``advantages``,
        ``response_mask`` (+ ``ref_log_probs`` with ``use_kl_loss``; no ``old_log_probs`` with
        ``actor.on_policy_old_log_probs``, see :func:`megaflow.workers.losses.actor_loss_fn`)."""
        return policy_update(self.role, data)


class RefWorker(MegatronWorker):
    """The frozen reference policy on the ``ref`` mesh (no optimizer)."""

    config_role, default_mesh = "ref", "ref"

    @register(nd_compute("ref"))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto | None:
        """``ref_log_probs`` ``[B, R]`` at the rollout temperature."""
        return reference_log_probs(self.role, data)


class CriticWorker(MegatronWorker):
    """The value model on the ``critic`` mesh."""

    config_role, default_mesh = "critic", "critic"

    @register(nd_compute("critic"))
    def compute_values(self, data: DataProto) -> DataProto | None:
        """``values`` ``[B, R]``: V of the state before each response token."""
        return value_estimates(self.role, data)

    @register(nd_compute("critic"))
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Clipped value regression on ``returns`` (returns the update's metrics); needs ``values`` (old), ``returns``,
        ``response_mask``."""
        return value_update(self.role, data)


class CostCriticWorker(MegatronWorker):
    """Safe RLHF's cost value model on the ``cost_critic`` mesh: the critic's computations and
    settings (the ``critic`` section), fitted to the cost's GAE returns
    (:mod:`megaflow.algorithms.safe_rlhf`). The controller sends the cost's values and returns
    under the critic's field names (``values``, ``returns``)."""

    config_role, default_mesh = "cost_critic", "cost_critic"

    @register(nd_compute("cost_critic"))
    def compute_values(self, data: DataProto) -> DataProto | None:
        """``values`` ``[B, R]``: the expected cost-to-go before each response token."""
        return value_estimates(self.role, data)

    @register(nd_compute("cost_critic"))
    def update_critic(self, data: DataProto) -> dict[str, float]:
        """Clipped value regression on the cost's ``returns`` (metrics ``critic/...``, which the
        controller renames ``cost_critic/...``); needs ``values``, ``returns``, ``response_mask``."""
        return value_update(self.role, data)


class RewardModelWorker(MegatronWorker):
    """A scalar-head reward model on the ``reward_model`` mesh (no optimizer)."""

    config_role, default_mesh = "reward_model", "reward_model"

    @register(nd_compute("reward_model"))
    def compute_rm_score(self, data: DataProto) -> DataProto | None:
        """``rm_scores`` ``[B, R]``: the score on the last real response token, 0 elsewhere."""
        out = self.role.forward(data)
        if out is None:
            return None
        resp_len = data.tensors["responses"].shape[1]
        real = data.tensors["attention_mask"][:, -resp_len:].cpu() != 0
        last = (real.cumsum(-1) == real.sum(-1, keepdim=True)) & real
        return DataProto.from_dict({"rm_scores": out["scores"] * last})


__all__ = ["MegatronWorker", "ActorWorker", "RefWorker", "CriticWorker", "CostCriticWorker", "RewardModelWorker",
           "TORCH_DTYPES", "rollout_sampling", "policy_log_probs", "reference_log_probs", "frozen_base_log_probs",
           "policy_update", "value_estimates", "value_update"]
