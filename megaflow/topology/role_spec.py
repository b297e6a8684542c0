"""What one Megatron worker role reads: the run's frozen :class:`~megaflow.config.schema.Config`
and the role's name, with the role's derived sizes computed from them on demand.

The Megatron workers (actor, ref, critic, reward model) and their engine receive a
:class:`RoleSpec` and read the config sections directly: the role's own section through
``spec.section`` (any role) or its typed accessor (``spec.actor``, ``spec.ref``,
``spec.critic``, ``spec.reward_model``), other sections through ``spec.config.algorithm``
and the like; the loss adapters get ``spec.config`` itself. The rollout is not a role of
its own here: its workers receive the actor's spec (the model they serve) and build the
vLLM engine's ``VLLMRolloutConfig`` from the ``rollout`` section. Sizes that are not
stored in the config (micro-batches, mini-batch rows per DP rank, the LR decay horizon,
the model source) come from the pure functions of :mod:`megaflow.topology.sizes`. Every
default lives in the config schema; the only values filled in here are the meanings the
schema documents for null (:attr:`RoleSpec.model_overrides`: ``recompute_method`` null is
uniform, ``recompute_num_layers`` null is 1). The object pickles as its plain config tree
(:meth:`RoleSpec.__reduce__`), so Ray and ``multiprocessing`` ship it with their standard
picklers and the receiver re-validates it (:func:`megaflow.topology.run.run_from_dict`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from megaflow.config.schema import (
    ROLES,
    ActorConfig,
    Config,
    CriticConfig,
    RefConfig,
    RewardModelConfig,
    TrainedRoleConfig,
)
from megaflow.topology.model_spec import model_spec
from megaflow.topology.run import run_from_dict
from megaflow.topology.sizes import (
    TRAINED_ROLES,
    MicroBatchSizes,
    ModelSource,
    RoleParallel,
    lr_schedule_steps,
    micro_batch_sizes,
    model_source,
    role_hf_config,
    role_parallel,
    train_batch_sizes,
    uses_distributed_optimizer,
)

#: The config section of a Megatron role.
RoleSection = ActorConfig | RefConfig | CriticConfig | RewardModelConfig
S = TypeVar("S", ActorConfig, RefConfig, CriticConfig, RewardModelConfig)


class _OwnSection(Generic[S]):
    """A typed accessor of one role's section on :class:`RoleSpec`, named after the role
    (``spec.critic`` is the ``CriticConfig`` of the critic's spec).

    Raises:
        ValueError: read on another role's spec.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.role = name

    def __get__(self, spec: RoleSpec, owner: type) -> S:
        if spec.role != self.role:
            raise ValueError(f"RoleSpec.{self.role}: this is the {spec.role!r} role's spec")
        return getattr(spec.config, self.role)


#: config section -> model head of megaflow.megatron.model.build_gpt_model and the engine
ROLE_HEADS = {"actor": "lm", "ref": "lm", "critic": "value", "reward_model": "reward", "cost_critic": "value"}
#: Roles without a config section of their own -> the section they read (Safe RLHF's cost
#: critic is a second critic group with the critic's settings and pool).
SECTION_OF = {"cost_critic": "critic"}


@dataclass(frozen=True)
class RoleSpec:
    """One role of a run: ``config`` (the loaded config) and ``role`` (its section name).

    Args:
        config: the validated run config.
        role: ``"actor"``, ``"ref"``, ``"critic"`` or ``"reward_model"``.
        training_steps: training steps of the run (:func:`~megaflow.topology.sizes.num_training_steps`),
            the horizon of the trained roles' LR decay.

    Raises:
        ValueError: an unknown role or ``training_steps < 1``.
    """

    config: Config
    role: str
    training_steps: int

    def __reduce__(self):
        """Pickle as the plain config tree (the frozen mappings of a Config do not pickle with
        the standard pickler, e.g. ``multiprocessing``'s); unpickling re-validates it."""
        return (_rebuild, (self.config.to_dict(), self.role, self.training_steps))

    def __post_init__(self) -> None:
        if self.role not in ROLES and self.role not in SECTION_OF:
            raise ValueError(f"RoleSpec.role must be one of {ROLES + tuple(SECTION_OF)}, got {self.role!r}")
        if self.training_steps < 1:
            raise ValueError(f"RoleSpec.training_steps must be >= 1, got {self.training_steps}")

    @property
    def section_role(self) -> str:
        """The config section (and placement) the role reads: its own name, or
        :data:`SECTION_OF`'s (``cost_critic`` -> ``critic``)."""
        return SECTION_OF.get(self.role, self.role)

    @property
    def section(self) -> RoleSection:
        """The role's config section (``config.actor``, ``config.critic``, ...)."""
        return getattr(self.config, self.section_role)

    @property
    def trained_section(self) -> TrainedRoleConfig | None:
        """The role's section when the role has an optimizer (actor, critic), else None."""
        section = self.section
        return section if self.trains and isinstance(section, TrainedRoleConfig) else None

    # The role's own section, typed: ``spec.actor`` on the actor's spec (ValueError on another role's).
    actor = _OwnSection[ActorConfig]()
    ref = _OwnSection[RefConfig]()
    critic = _OwnSection[CriticConfig]()
    reward_model = _OwnSection[RewardModelConfig]()

    @property
    def head(self) -> str:
        """Model head: ``"lm"`` (LM head: actor, ref), ``"value"`` (critic) or ``"reward"`` (reward
        model); the last two are scalar heads (:data:`megaflow.megatron.model.HEADS`)."""
        return ROLE_HEADS[self.role]

    @property
    def trains(self) -> bool:
        """Whether the role has an optimizer (actor, critic)."""
        return self.section_role in TRAINED_ROLES

    @property
    def parallel(self) -> RoleParallel:
        """The role's Megatron mesh (tp, pp, cp, vpp; dp derived from its pool)."""
        return role_parallel(self.config, self.section_role)

    @property
    def micro_batches(self) -> MicroBatchSizes:
        """Micro-batch sizes and token budgets of the role's engine."""
        return micro_batch_sizes(self.config, self.section_role)

    @property
    def mini_batch_size_per_dp_rank(self) -> int:
        """Samples of one mini-batch (one optimizer step) on one DP rank (trained roles only).

        Raises:
            ValueError: the role does not train.
        """
        self._require_training("mini_batch_size_per_dp_rank")
        return train_batch_sizes(self.config, self.section_role).mini_batch_size_per_dp_rank

    @property
    def lr_decay_steps(self) -> int:
        """Optimizer step at which the LR decay reaches ``min_lr`` (trained roles only;
        :func:`~megaflow.topology.sizes.lr_schedule_steps` over ``training_steps``)."""
        self._require_training("lr_decay_steps")
        return lr_schedule_steps(self.config, self.section_role, self.training_steps)

    @property
    def distributed_optimizer(self) -> bool:
        """Megatron's distributed optimizer or the plain one
        (:func:`~megaflow.topology.sizes.uses_distributed_optimizer`; trained roles only)."""
        self._require_training("distributed_optimizer")
        return uses_distributed_optimizer(self.config, self.section_role)

    @property
    def shuffle(self) -> bool:
        """Whether a rank's rows are permuted before each PPO epoch is cut into mini-batches:
        ``actor.shuffle`` for the actor; the critic has no such key and keeps the row order."""
        return self.role == "actor" and self.actor.shuffle

    @property
    def model_source(self) -> ModelSource:
        """The model path or inline HF config of the role (:func:`~megaflow.topology.sizes.model_source`)."""
        return model_source(self.config, self.section_role)

    def hf_config(self) -> dict[str, Any]:
        """A fresh plain dict of the role's HF config (config.json of the path, or the inline one).

        Raises:
            ConfigError: the path has no readable config.json.
        """
        return role_hf_config(self.config, self.section_role)

    @property
    def offload(self) -> dict[str, bool]:
        """What stays on the host between phases: ``params``, ``grads``, ``optimizer``
        (``<role>.param_offload`` / ``grad_offload`` / ``optimizer_offload``; a role without
        an optimizer has no gradients or optimizer state to offload)."""
        trained = self.trained_section
        return {"params": self.section.param_offload,
                "grads": trained is not None and trained.grad_offload,
                "optimizer": trained is not None and trained.optimizer_offload}

    @property
    def model_overrides(self) -> dict[str, Any]:
        """megatron-core ``TransformerConfig`` fields of the role's scale features for
        :func:`megaflow.megatron.model.build_gpt_model`: sequence parallelism (only where
        tp > 1) and, for the trained roles, activation recomputation (``recompute_method``
        None: uniform; ``recompute_num_layers`` None: 1, as the config documents), and the
        MoE routers' replay (``moe_enable_routing_replay``) of a mixture-of-experts actor: its
        record / replay hooks (:mod:`megaflow.megatron.routing_replay`) serve
        ``actor.router_replay`` and, under every setting, the routing-agreement metric (the
        old-log-prob forward records the router's top-k); idle, the router is megatron-core's."""
        section, trained = self.section, self.trained_section
        out: dict[str, Any] = {"sequence_parallel": section.sequence_parallel and section.tp > 1}
        granularity = trained.recompute_granularity if trained is not None else "none"
        if trained is not None and granularity == "full":
            out.update(recompute_granularity="full", recompute_method=trained.recompute_method or "uniform",
                       recompute_num_layers=trained.recompute_num_layers or 1)
        elif granularity == "selective":
            out.update(recompute_granularity="selective")
        if self.role == "actor" and (self.actor.router_replay != "off" or model_spec(self.hf_config()).is_moe):
            out["moe_enable_routing_replay"] = True  # megaflow.megatron.routing_replay
        return out

    def _require_training(self, name: str) -> None:
        if not self.trains:
            raise ValueError(f"RoleSpec.{name}: role {self.role!r} does not train")


def _rebuild(tree: dict[str, Any], role: str, training_steps: int) -> RoleSpec:
    return RoleSpec(run_from_dict(tree), role, training_steps)


__all__ = ["RoleSpec", "RoleSection", "ROLE_HEADS", "SECTION_OF"]
