"""What the controller may call on each role's worker group, with the batch each call reads.

A :class:`~megaflow.single_controller.RayWorkerGroup` exposes every ``@register``-ed
method of its worker class as a group method (bound when the group is built). The
protocols below are the typed face of those groups: one per role, one method per
registered worker method, with the same parameters and the *group's* return value
(``Dispatch.ONE_TO_ALL``: the list of per-rank returns, index = rank; ``nd_compute``: the
collected :class:`~megaflow.protocol.DataProto` of all rows, or a
:class:`~megaflow.single_controller.GroupProtoResult` of the rows and each DP rank's
metrics when the worker returns a :class:`~megaflow.single_controller.ProtoResult`). Each method's docstring
names the worker method that runs. ``tests/trainer/test_worker_api.py`` checks the
protocols against the worker classes' registered methods, so the two cannot drift.

Batch methods also declare the fields they read (:func:`reads`); the controller sends
only those (:func:`inputs_for`), so a call does not ship the step's whole growing batch
(raw prompts, scores, other roles' outputs) to every rank. Shapes: ``B`` rows, ``S``
tokens (prompt + response), ``R`` response tokens; field meanings in
:mod:`megaflow.protocol`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, TypeVar

from megaflow.protocol import DataProto
from megaflow.single_controller.collect import GroupProtoResult
from megaflow.single_controller.dispatch import MeshInfo
from megaflow.single_controller.worker import DPInfo

F = TypeVar("F", bound=Callable[..., Any])

#: The tensors every Megatron forward reads (:func:`megaflow.megatron.batch.left_align_batch`):
#: ``input_ids``/``attention_mask`` ``[B, S]``, ``responses`` ``[B, R]``. ``position_ids``
#: are not sent: Megatron's RoPE uses the left-aligned positions, and the controller checks them
#: once per step (:func:`megaflow.trainer.stages.check_rollout_batch`).
FORWARD_KEYS = ("input_ids", "attention_mask", "responses")
#: The prompt tensors the rollout reads, ``[B, P]`` (left-padded; the engine takes each
#: row's real tokens and numbers positions itself).
PROMPT_KEYS = ("input_ids", "attention_mask")

_READS_ATTR = "__megaflow_reads__"


@dataclass(frozen=True)
class Reads:
    """The part of a batch one worker call reads.

    Attributes:
        tensors: tensor fields that must be present.
        optional: tensor fields sent when the batch has them (e.g. ``ref_log_probs`` with
            a KL loss, ``rollout_is_weights`` with importance weighting).
        meta: ``meta_info`` keys sent when present.
    """

    tensors: tuple[str, ...]
    optional: tuple[str, ...] = ()
    meta: tuple[str, ...] = ()


def reads(tensors: tuple[str, ...], optional: tuple[str, ...] = (), meta: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Declare on a protocol method which batch fields its worker method reads (see :class:`Reads`)."""
    def mark(fn: F) -> F:
        setattr(fn, _READS_ATTR, Reads(tuple(tensors), tuple(optional), tuple(meta)))
        return fn
    return mark


def declared_reads(method: Callable[..., Any]) -> Reads:
    """The :class:`Reads` of a protocol method (e.g. ``ActorRolloutGroup.update_actor``).

    Raises:
        TypeError: ``method`` declares no reads (not a batch method of a protocol).
    """
    spec = getattr(method, _READS_ATTR, None)
    if not isinstance(spec, Reads):
        raise TypeError(f"{getattr(method, '__qualname__', method)!r} declares no batch fields (@reads)")
    return spec


def inputs_for(method: Callable[..., Any], batch: DataProto) -> DataProto:
    """The fields of ``batch`` that the protocol ``method`` reads, as a new DataProto.

    The required tensors, the optional tensors present, the declared ``meta_info`` keys
    present, and no non-tensor fields. Tensors are shared, not copied.

    Raises:
        KeyError: a required tensor is missing (the method and the missing field named).
    """
    spec = declared_reads(method)
    present = set(batch.batch.keys()) if batch.batch is not None else set()
    missing = [k for k in spec.tensors if k not in present]
    if missing:
        raise KeyError(f"{method.__qualname__} reads {missing}, which the batch lacks; it has {sorted(present)}")
    keys = list(spec.tensors) + [k for k in spec.optional if k in present]
    return batch.select(batch_keys=keys, non_tensor_keys=[],
                        meta_info_keys=[k for k in spec.meta if k in batch.meta_info])


class RoleGroup(Protocol):
    """What every worker group offers besides its role's methods
    (:class:`~megaflow.single_controller.RayWorkerGroup`)."""

    @property
    def world_size(self) -> int:
        """Ranks in the group."""

    def mesh_info(self, mesh: str) -> MeshInfo:
        """The group's cached layout of ``mesh`` (``dp_size``, per-rank DP rank and collect flag)."""

    def shutdown(self) -> None:
        """Stop the group's processes."""

    def get_dp_info(self, mesh: str) -> list[DPInfo]:
        """``Worker.get_dp_info`` on every rank: each rank's place in ``mesh`` (what
        :meth:`mesh_info` caches)."""


class MegatronRoleGroup(RoleGroup, Protocol):
    """The methods of every Megatron role (:class:`~megaflow.workers.megatron_workers.MegatronWorker`)."""

    def init_model(self) -> list[None]:
        """``MegatronWorker.init_model`` on every rank (collective): build and load the model."""

    def save_checkpoint(self, path: str) -> list[None]:
        """``MegatronWorker.save_checkpoint`` on every rank: model, optimizer, LR schedule to ``path``."""

    def load_checkpoint(self, path: str) -> list[None]:
        """``MegatronWorker.load_checkpoint`` on every rank: restore what ``save_checkpoint`` wrote."""

    def export_hf(self, path: str, overwrite: bool = False) -> list[None]:
        """``MegatronWorker.export_hf`` on every rank: the model as a Hugging Face directory at ``path``."""


class ActorRolloutGroup(MegatronRoleGroup, Protocol):
    """The actor with its colocated rollout engines
    (:class:`~megaflow.workers.actor_rollout.ActorRolloutWorker`)."""

    def sync_rollout_weights(self, verify: bool = False, bucket_mb: int = 512) -> list[dict[str, float]]:
        """``ActorRolloutWorker.sync_rollout_weights`` on every rank: reshard the actor's
        weights into the engines when they changed, pushing at most ``bucket_mb`` MiB at a
        time. Returns each rank's version metrics (check them with
        :func:`megaflow.workers.actor_rollout.check_synced`)."""

    def rollout_weight_version(self) -> list[int]:
        """``ActorRolloutWorker.rollout_weight_version`` on every rank: engine syncs so far."""

    @reads(PROMPT_KEYS, meta=("temperature", "top_p", "top_k", "response_length", "do_sample", "seed"))
    def generate_sequences(self, prompts: DataProto) -> GroupProtoResult:
        """``ActorRolloutWorker.generate_sequences`` on the ``rollout`` mesh.

        Reads ``input_ids``, ``attention_mask`` ``[B, P]`` (left-padded prompts) and the
        sampling parameters in ``meta_info``. Returns the rows (``prompts`` ``[B, P]``,
        ``responses``, ``response_mask``, ``rollout_log_probs`` ``[B, R]``, ``input_ids``,
        ``attention_mask``, ``position_ids`` ``[B, S]``) and each generation replica's
        metrics (``rollout/weight_version``), index = replica.
        """

    @reads(FORWARD_KEYS, meta=("temperature",))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``ActorWorker.compute_log_prob`` on the ``actor`` mesh: ``old_log_probs`` and
        ``entropys`` ``[B, R]`` (float32) at the rollout temperature."""

    @reads(FORWARD_KEYS + ("response_mask", "advantages"),
           optional=("old_log_probs", "ref_log_probs", "rollout_is_weights", "rollout_log_probs"),
           meta=("temperature",))
    def update_actor(self, data: DataProto) -> list[dict[str, float]]:
        """``ActorRolloutWorker.update_actor`` on the ``actor`` mesh: PPO epochs over
        mini-batches. Reads ``response_mask``, ``old_log_probs``, ``advantages`` ``[B, R]``
        (+ ``ref_log_probs`` with a KL loss, ``rollout_is_weights`` with importance
        weights; without ``old_log_probs`` under ``actor.on_policy_old_log_probs``, which
        compares the update's log-probs with ``rollout_log_probs``). Returns the update's
        metrics per DP rank, in DP order (``actor/pg_loss``, ``actor/grad_norm``, ...; the
        same on every rank)."""


class SplitActorGroup(ActorRolloutGroup, Protocol):
    """The actor of split placement, without an engine; its syncs broadcast to a
    :class:`RolloutGroup` (:class:`~megaflow.workers.rollout_worker.SplitActorWorker`)."""

    def open_weight_store(self) -> tuple[str, int]:
        """``SplitActorWorker.open_weight_store`` on rank 0: the transport's ``TCPStore``
        ``(host, port)``."""

    def init_weight_transport(self, host: str, port: int, plan, vllm_shapes: list, backend: str) -> list[None]:
        """``SplitActorWorker.init_weight_transport`` on every rank: join the broadcast group
        a rank is the source of (``vllm_shapes[j]``: generation TP rank ``j``'s shard shapes)."""

    @reads(PROMPT_KEYS, meta=("temperature", "top_p", "top_k", "response_length", "do_sample", "seed"))
    def generate_sequences(self, prompts: DataProto) -> GroupProtoResult:
        """``SplitActorWorker.generate_sequences``: refused (the rollout group generates)."""


class RolloutGroup(RoleGroup, Protocol):
    """The rollout pool of split placement: vLLM engine shards fed by the actor over a
    transport (:class:`~megaflow.workers.rollout_worker.RolloutWorker`)."""

    def init_model(self) -> list[None]:
        """``RolloutWorker.init_model`` on every rank: join the group's world, build the engine."""

    def sharded_param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """``RolloutWorker.sharded_param_shapes`` on every rank: vLLM name -> shard shape."""

    def init_weight_transport(self, host: str, port: int, plan, backend: str) -> list[None]:
        """``RolloutWorker.init_weight_transport`` on every rank: join its broadcast group."""

    def receive_weights(self) -> list[dict[str, float]]:
        """``RolloutWorker.receive_weights`` on every rank: one sync from the actor (collective
        with the actor's ``sync_rollout_weights``); each rank's version metrics."""

    @reads(PROMPT_KEYS, meta=("temperature", "top_p", "top_k", "response_length", "do_sample", "seed"))
    def generate_sequences(self, prompts: DataProto) -> GroupProtoResult:
        """``RolloutWorker.generate_sequences`` on the ``rollout`` mesh: the contract of
        :meth:`ActorRolloutGroup.generate_sequences`, plus ``weight_version`` ``[B]`` and
        ``timeline/gen_start_unix`` / ``timeline/gen_end_unix`` in each replica's metrics."""

    def rollout_weight_version(self) -> list[int]:
        """``RolloutWorker.rollout_weight_version`` on every rank: engine syncs so far."""

    def probe_rollout(self) -> list[DataProto]:
        """``RolloutWorker.probe_rollout`` on every rank: its replica's greedy rollout of the
        fixed probe (``rollout.verify_sync``)."""


class RefGroup(MegatronRoleGroup, Protocol):
    """The frozen reference policy (:class:`~megaflow.workers.megatron_workers.RefWorker`)."""

    @reads(FORWARD_KEYS, meta=("temperature",))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``RefWorker.compute_ref_log_prob`` on the ``ref`` mesh: ``ref_log_probs`` ``[B, R]``."""


class CriticGroup(MegatronRoleGroup, Protocol):
    """The value model (:class:`~megaflow.workers.megatron_workers.CriticWorker`)."""

    @reads(FORWARD_KEYS)
    def compute_values(self, data: DataProto) -> DataProto:
        """``CriticWorker.compute_values`` on the ``critic`` mesh: ``values`` ``[B, R]``, V
        of the state before each response token."""

    @reads(FORWARD_KEYS + ("response_mask", "values", "returns"))
    def update_critic(self, data: DataProto) -> list[dict[str, float]]:
        """``CriticWorker.update_critic`` on the ``critic`` mesh: clipped value regression
        of ``values`` (old, ``[B, R]``) towards ``returns`` ``[B, R]`` on ``response_mask``.
        Returns the update's metrics per DP rank, in DP order (``critic/vf_loss``, ...; the
        same on every rank)."""


class RewardModelGroup(MegatronRoleGroup, Protocol):
    """A scalar-head reward model (:class:`~megaflow.workers.megatron_workers.RewardModelWorker`)."""

    @reads(FORWARD_KEYS)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``RewardModelWorker.compute_rm_score`` on the ``reward_model`` mesh: ``rm_scores``
        ``[B, R]``, the score on the last real response token and 0 elsewhere."""


#: Members of :class:`RoleGroup`: the group's own methods, not a worker's.
GROUP_MEMBERS = ("world_size", "mesh_info", "shutdown")

__all__ = ["ActorRolloutGroup", "SplitActorGroup", "RolloutGroup", "RefGroup", "CriticGroup", "RewardModelGroup", "MegatronRoleGroup", "RoleGroup",
           "Reads", "reads", "declared_reads", "inputs_for", "FORWARD_KEYS", "PROMPT_KEYS", "GROUP_MEMBERS"]
