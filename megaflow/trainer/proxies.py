"""One hand-written typed proxy per role: what the controller may call on each role's worker
group, with the batch each call reads and the value it returns.

A :class:`~megaflow.single_controller.RayWorkerGroup` runs any ``@register``-ed method of
its worker class by name (:meth:`~megaflow.single_controller.RayWorkerGroup.call`,
non-blocking :meth:`~megaflow.single_controller.RayWorkerGroup.submit`). The proxies below
are the controller's only way to it: one class per role (:class:`ActorProxy`,
:class:`RolloutProxy`, :class:`RefProxy`, :class:`CriticProxy`, :class:`RewardModelProxy`),
one method per registered worker method, with the worker's parameters and the *group's*
return value (``Dispatch.ONE_TO_ALL``: the list of per-rank returns, index = rank;
``RANK_ZERO``: rank 0's return; ``nd_compute``: the collected
:class:`~megaflow.protocol.DataProto` of all rows, or a
:class:`~megaflow.single_controller.GroupProtoResult` of the rows and each DP rank's
metrics when the worker returns a :class:`~megaflow.single_controller.ProtoResult`).
Asynchronous calls are methods too (``<method>_async``, returning a future whose ``get()``
is the blocking call's value). Each method's docstring names the worker method that runs;
``tests/trainer/test_proxies.py`` checks the proxies against the worker classes' registered
methods, so the two cannot drift.

Batch methods also declare the fields they read (:func:`reads`); the proxy sends only those
(:func:`inputs_for`), so a call does not ship the step's whole growing batch (raw prompts,
scores, other roles' outputs) to every rank. Shapes: ``B`` rows, ``S`` tokens (prompt +
response), ``R`` response tokens; field meanings in :mod:`megaflow.protocol`.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from megaflow.agent.vllm_agent import AGENT_INPUT_KEYS  # sent by the controller with rollout.agent.enabled only
from megaflow.megatron.batch import OLD_ROUTED_EXPERTS_KEY, ROUTED_EXPERTS_KEY
from megaflow.protocol import DataProto
from megaflow.single_controller.collect import GroupProtoResult
from megaflow.single_controller.dispatch import MeshInfo
from megaflow.single_controller.futures import DataProtoFuture, GroupFuture
from megaflow.single_controller.worker import DPInfo, WorkerMetadata
from megaflow.trainer.stages import PROMPT_KEYS

if TYPE_CHECKING:
    from megaflow.hybrid_engine.transport import TransportPlan
    from megaflow.single_controller import ResourcePool
    from megaflow.workers.weight_sync import WeightSync

F = TypeVar("F", bound=Callable[..., Any])

#: The tensors every Megatron forward reads (:func:`megaflow.megatron.batch.left_align_batch`):
#: ``input_ids``/``attention_mask`` ``[B, S]``, ``responses`` ``[B, R]``. ``position_ids``
#: are not sent: Megatron's RoPE uses the left-aligned positions, and the controller checks them
#: once per step (:func:`megaflow.trainer.stages.check_rollout_batch`).
FORWARD_KEYS = ("input_ids", "attention_mask", "responses")
#: The sampling parameters a generate call reads from ``meta_info``.
SAMPLING_META = ("temperature", "top_p", "top_k", "response_length", "do_sample", "seed")

_READS_ATTR = "__megaflow_reads__"


@dataclass(frozen=True)
class Reads:
    """The part of a batch one worker call reads.

    Attributes:
        tensors: tensor fields that must be present.
        optional: tensor fields sent when the batch has them (e.g. ``ref_log_probs`` with
            a KL loss, ``rollout_is_weights`` with importance weighting).
        meta: ``meta_info`` keys sent when present.
        non_tensors: non-tensor fields sent when present (the agent loop's messages and tools).
    """

    tensors: tuple[str, ...]
    optional: tuple[str, ...] = ()
    meta: tuple[str, ...] = ()
    non_tensors: tuple[str, ...] = ()


def reads(tensors: tuple[str, ...], optional: tuple[str, ...] = (), meta: tuple[str, ...] = (),
          non_tensors: tuple[str, ...] = ()) -> Callable[[F], F]:
    """Declare on a proxy method which batch fields its worker method reads (see :class:`Reads`)."""
    def mark(fn: F) -> F:
        setattr(fn, _READS_ATTR, Reads(tuple(tensors), tuple(optional), tuple(meta), tuple(non_tensors)))
        return fn
    return mark


def declared_reads(method: Callable[..., Any]) -> Reads:
    """The :class:`Reads` of a proxy method (e.g. ``ActorProxy.update_actor``).

    Raises:
        TypeError: ``method`` declares no reads (not a batch method of a proxy).
    """
    spec = getattr(method, _READS_ATTR, None)
    if not isinstance(spec, Reads):
        raise TypeError(f"{getattr(method, '__qualname__', method)!r} declares no batch fields (@reads)")
    return spec


def inputs_for(method: Callable[..., Any], batch: DataProto) -> DataProto:
    """The fields of ``batch`` that the proxy ``method`` reads, as a new DataProto.

    The required tensors, the optional tensors present, the declared ``meta_info`` keys
    and non-tensor fields present. Tensors are shared, not copied.

    Raises:
        KeyError: a required tensor is missing (the method and the missing field named).
    """
    spec = declared_reads(method)
    present = set(batch.batch.keys()) if batch.batch is not None else set()
    missing = [k for k in spec.tensors if k not in present]
    if missing:
        raise KeyError(f"{method.__qualname__} reads {missing}, which the batch lacks; it has {sorted(present)}")
    keys = list(spec.tensors) + [k for k in spec.optional if k in present]
    return batch.select(batch_keys=keys, non_tensor_keys=[k for k in spec.non_tensors if k in batch.non_tensor_batch],
                        meta_info_keys=[k for k in spec.meta if k in batch.meta_info])


class WorkerGroupLike(Protocol):
    """What a proxy needs of a worker group (:class:`~megaflow.single_controller.RayWorkerGroup`)."""

    @property
    def world_size(self) -> int:
        """Ranks in the group."""

    @property
    def worker_metadata(self) -> list[WorkerMetadata]:
        """Per-rank process metadata, index = rank."""

    def mesh_info(self, mesh: str) -> MeshInfo:
        """The group's cached layout of ``mesh``."""

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run a registered worker method and return the collected value."""

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start a registered worker method; a future of the collected value."""

    def shutdown(self) -> None:
        """Stop the group's processes."""


class RoleProxy:
    """What every role's proxy offers besides the role's methods.

    Args:
        group: the role's worker group (or a view of colocated roles).
    """

    def __init__(self, group: WorkerGroupLike) -> None:
        self.group = group

    @property
    def world_size(self) -> int:
        """Ranks in the group."""
        return self.group.world_size

    @property
    def worker_metadata(self) -> list[WorkerMetadata]:
        """Per-rank :class:`~megaflow.single_controller.worker.WorkerMetadata` (node, pid),
        index = rank: where a failure happened."""
        return self.group.worker_metadata

    def mesh_info(self, mesh: str) -> MeshInfo:
        """The group's cached layout of ``mesh`` (``dp_size``, per-rank DP rank and collect flag)."""
        return self.group.mesh_info(mesh)

    def shutdown(self) -> None:
        """Stop the group's processes (all colocated roles)."""
        self.group.shutdown()

    def get_dp_info(self, mesh: str) -> list[DPInfo]:
        """``Worker.get_dp_info`` on every rank: each rank's place in ``mesh`` (what
        :meth:`mesh_info` caches)."""
        return self._run(RoleProxy.get_dp_info, mesh)

    def _run(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run the worker method named like the proxy ``method`` (a batch method sends only
        the fields it declares)."""
        return self.group.call(method.__name__, *self._inputs(method, args), **kwargs)

    def _start(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """:meth:`_run` without waiting (``method``: the blocking proxy method): a future of
        the blocking call's value."""
        return self.group.submit(method.__name__, *self._inputs(method, args), **kwargs)

    @staticmethod
    def _inputs(method: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
        if getattr(method, _READS_ATTR, None) is None:
            return args
        return tuple(inputs_for(method, a) if isinstance(a, DataProto) else a for a in args)


class MegatronProxy(RoleProxy):
    """The methods of every Megatron role (:class:`~megaflow.workers.megatron_workers.MegatronWorker`)."""

    def init_model(self) -> list[None]:
        """``MegatronWorker.init_model`` on every rank (collective): build and load the model."""
        return self._run(MegatronProxy.init_model)

    def init_model_async(self) -> GroupFuture:
        """:meth:`init_model` without waiting (roles on different pools start together)."""
        return self._start(MegatronProxy.init_model)

    def save_checkpoint(self, path: str) -> list[None]:
        """``MegatronWorker.save_checkpoint`` on every rank: model, optimizer, LR schedule to ``path``."""
        return self._run(MegatronProxy.save_checkpoint, path)

    def load_checkpoint(self, path: str) -> list[None]:
        """``MegatronWorker.load_checkpoint`` on every rank: restore what ``save_checkpoint`` wrote."""
        return self._run(MegatronProxy.load_checkpoint, path)

    def export_hf(self, path: str, overwrite: bool = False) -> list[None]:
        """``MegatronWorker.export_hf`` on every rank: the model as a Hugging Face directory at ``path``."""
        return self._run(MegatronProxy.export_hf, path, overwrite)


class ActorProxy(MegatronProxy):
    """The actor: with its rollout engines in its processes
    (:class:`~megaflow.workers.actor_rollout.ActorRolloutWorker`), or, under split placement,
    without engines, its syncs broadcasting to a :class:`RolloutProxy`
    (:class:`~megaflow.workers.rollout_worker.SplitActorWorker`)."""

    def sync_rollout_weights(self, verify: bool = False, bucket_mb: int = 512) -> list[WeightSync]:
        """``ActorRolloutWorker.sync_rollout_weights`` on every rank: reshard the actor's
        weights into the engines when they changed, pushing at most ``bucket_mb`` MiB at a
        time. Returns each rank's :class:`~megaflow.workers.weight_sync.WeightSync` (check
        them with :func:`megaflow.workers.actor_rollout.check_synced`)."""
        return self._run(ActorProxy.sync_rollout_weights, verify, bucket_mb)

    def sync_rollout_weights_async(self, verify: bool = False, bucket_mb: int = 512) -> GroupFuture:
        """:meth:`sync_rollout_weights` without waiting (split placement: the broadcast, in
        lockstep with :meth:`RolloutProxy.receive_weights_async`)."""
        return self._start(ActorProxy.sync_rollout_weights, verify, bucket_mb)

    def rollout_weight_version(self) -> list[int]:
        """``ActorRolloutWorker.rollout_weight_version`` on every rank: engine syncs so far."""
        return self._run(ActorProxy.rollout_weight_version)

    @reads(PROMPT_KEYS, meta=SAMPLING_META, non_tensors=AGENT_INPUT_KEYS)
    def generate_sequences(self, prompts: DataProto) -> GroupProtoResult:
        """``ActorRolloutWorker.generate_sequences`` on the ``rollout`` mesh.

        Reads ``input_ids``, ``attention_mask`` ``[B, P]`` (left-padded prompts) and the
        sampling parameters in ``meta_info``. Returns the rows (``prompts`` ``[B, P]``,
        ``responses``, ``response_mask``, ``rollout_log_probs`` ``[B, R]``, ``input_ids``,
        ``attention_mask``, ``position_ids`` ``[B, S]``) and each generation replica's
        metrics (``rollout/weight_version``), index = replica. (Split placement: the actor
        has no engine and no such method, the rollout group generates.)
        """
        return self._run(ActorProxy.generate_sequences, prompts)

    @reads(FORWARD_KEYS, optional=(ROUTED_EXPERTS_KEY,), meta=("temperature",))
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``ActorWorker.compute_log_prob`` on the ``actor`` mesh: ``old_log_probs`` and
        ``entropys`` ``[B, R]`` (float32) at the rollout temperature, and for a MoE actor with
        R2 (or the rollout's ``routed_experts``) ``old_routed_experts`` ``[B, S, layers, topk]``."""
        return self._run(ActorProxy.compute_log_prob, data)

    @reads(FORWARD_KEYS, optional=(ROUTED_EXPERTS_KEY,), meta=("temperature",))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ActorWorker.compute_ref_log_prob`` on the ``actor`` mesh (``actor.lora.rank > 0``):
        ``ref_log_probs`` ``[B, R]`` of the actor's frozen base, adapters disabled."""
        return self._run(ActorProxy.compute_ref_log_prob, data)

    @reads(FORWARD_KEYS + ("response_mask", "advantages"),
           optional=("old_log_probs", "ref_log_probs", "rollout_is_weights", "rollout_log_probs", ROUTED_EXPERTS_KEY,
                     OLD_ROUTED_EXPERTS_KEY),
           meta=("temperature",))
    def update_actor(self, data: DataProto) -> list[dict[str, float]]:
        """``ActorRolloutWorker.update_actor`` on the ``actor`` mesh: PPO epochs over
        mini-batches. Reads ``response_mask``, ``old_log_probs``, ``advantages`` ``[B, R]``
        (+ ``ref_log_probs`` with a KL loss, ``rollout_is_weights`` with importance
        weights; without ``old_log_probs`` under ``actor.on_policy_old_log_probs``, which
        compares the update's log-probs with ``rollout_log_probs``). Returns the update's
        metrics per DP rank, in DP order (``actor/pg_loss``, ``actor/grad_norm``, ...; the
        same on every rank)."""
        return self._run(ActorProxy.update_actor, data)

    def update_actor_async(self, data: DataProto) -> DataProtoFuture:
        """:meth:`update_actor` without waiting (its future's ``get()`` is the per-DP-rank metrics)."""
        return self._start(ActorProxy.update_actor, data)

    def open_weight_store(self) -> tuple[str, int]:
        """``SplitActorWorker.open_weight_store`` on rank 0: the transport's ``TCPStore``
        ``(host, port)``."""
        return self._run(ActorProxy.open_weight_store)

    def init_weight_transport(self, host: str, port: int, plan: TransportPlan, vllm_shapes: list,
                              backend: str) -> list[None]:
        """``SplitActorWorker.init_weight_transport`` on every rank: join the broadcast group
        a rank is the source of (``vllm_shapes[j]``: generation TP rank ``j``'s shard shapes)."""
        return self._run(ActorProxy.init_weight_transport, host, port, plan, vllm_shapes, backend)

    def init_weight_transport_async(self, host: str, port: int, plan: TransportPlan, vllm_shapes: list,
                                    backend: str) -> GroupFuture:
        """:meth:`init_weight_transport` without waiting (it rendezvouses with the rollout group's)."""
        return self._start(ActorProxy.init_weight_transport, host, port, plan, vllm_shapes, backend)


class RolloutProxy(RoleProxy):
    """The rollout pool of split placement: vLLM engine shards fed by the actor over a
    transport (:class:`~megaflow.workers.rollout_worker.RolloutWorker`)."""

    def init_model(self) -> list[None]:
        """``RolloutWorker.init_model`` on every rank: join the group's world, build the engine."""
        return self._run(RolloutProxy.init_model)

    def init_model_async(self) -> GroupFuture:
        """:meth:`init_model` without waiting."""
        return self._start(RolloutProxy.init_model)

    def sharded_param_shapes(self) -> list[dict[str, tuple[int, ...]]]:
        """``RolloutWorker.sharded_param_shapes`` on every rank: vLLM name -> shard shape."""
        return self._run(RolloutProxy.sharded_param_shapes)

    def init_weight_transport(self, host: str, port: int, plan: TransportPlan, backend: str) -> list[None]:
        """``RolloutWorker.init_weight_transport`` on every rank: join its broadcast group."""
        return self._run(RolloutProxy.init_weight_transport, host, port, plan, backend)

    def init_weight_transport_async(self, host: str, port: int, plan: TransportPlan, backend: str) -> GroupFuture:
        """:meth:`init_weight_transport` without waiting (it rendezvouses with the actor's)."""
        return self._start(RolloutProxy.init_weight_transport, host, port, plan, backend)

    def receive_weights(self) -> list[WeightSync]:
        """``RolloutWorker.receive_weights`` on every rank: one sync from the actor (collective
        with the actor's ``sync_rollout_weights``); each rank's
        :class:`~megaflow.workers.weight_sync.WeightSync`."""
        return self._run(RolloutProxy.receive_weights)

    def receive_weights_async(self) -> GroupFuture:
        """:meth:`receive_weights` without waiting (in lockstep with the actor's broadcast)."""
        return self._start(RolloutProxy.receive_weights)

    @reads(PROMPT_KEYS, meta=SAMPLING_META, non_tensors=AGENT_INPUT_KEYS)
    def generate_sequences(self, prompts: DataProto) -> GroupProtoResult:
        """``RolloutWorker.generate_sequences`` on the ``rollout`` mesh: the contract of
        :meth:`ActorProxy.generate_sequences`, plus ``weight_version`` ``[B]`` and
        ``timeline/gen_start_unix`` / ``timeline/gen_end_unix`` in each replica's metrics."""
        return self._run(RolloutProxy.generate_sequences, prompts)

    def generate_sequences_async(self, prompts: DataProto) -> DataProtoFuture:
        """:meth:`generate_sequences` without waiting (one step off: the next batch is
        generated while the actor trains)."""
        return self._start(RolloutProxy.generate_sequences, prompts)

    def rollout_weight_version(self) -> list[int]:
        """``RolloutWorker.rollout_weight_version`` on every rank: engine syncs so far."""
        return self._run(RolloutProxy.rollout_weight_version)

    def probe_rollout(self) -> list[DataProto]:
        """``RolloutWorker.probe_rollout`` on every rank: its replica's greedy rollout of the
        fixed probe (``rollout.verify_sync``)."""
        return self._run(RolloutProxy.probe_rollout)


class RefProxy(MegatronProxy):
    """The frozen reference policy (:class:`~megaflow.workers.megatron_workers.RefWorker`)."""

    @reads(FORWARD_KEYS, meta=("temperature",))
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``RefWorker.compute_ref_log_prob`` on the ``ref`` mesh: ``ref_log_probs`` ``[B, R]``."""
        return self._run(RefProxy.compute_ref_log_prob, data)


class CriticProxy(MegatronProxy):
    """The value model (:class:`~megaflow.workers.megatron_workers.CriticWorker`)."""

    @reads(FORWARD_KEYS)
    def compute_values(self, data: DataProto) -> DataProto:
        """``CriticWorker.compute_values`` on the ``critic`` mesh: ``values`` ``[B, R]``, V
        of the state before each response token."""
        return self._run(CriticProxy.compute_values, data)

    @reads(FORWARD_KEYS + ("response_mask", "values", "returns"))
    def update_critic(self, data: DataProto) -> list[dict[str, float]]:
        """``CriticWorker.update_critic`` on the ``critic`` mesh: clipped value regression
        of ``values`` (old, ``[B, R]``) towards ``returns`` ``[B, R]`` on ``response_mask``.
        Returns the update's metrics per DP rank, in DP order (``critic/vf_loss``, ...; the
        same on every rank)."""
        return self._run(CriticProxy.update_critic, data)


class CostCriticProxy(CriticProxy):
    """Safe RLHF's cost value model (:class:`~megaflow.workers.megatron_workers.CostCriticWorker`):
    ``compute_values`` and ``update_critic`` on the ``cost_critic`` mesh, with the cost's values
    and returns under the critic's field names."""


class RewardModelProxy(MegatronProxy):
    """A scalar-head reward model (:class:`~megaflow.workers.megatron_workers.RewardModelWorker`)."""

    @reads(FORWARD_KEYS)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``RewardModelWorker.compute_rm_score`` on the ``reward_model`` mesh: ``rm_scores``
        ``[B, R]``, the score on the last real response token and 0 elsewhere."""
        return self._run(RewardModelProxy.compute_rm_score, data)


#: Members of :class:`RoleProxy`: the group's own methods, not a worker's.
GROUP_MEMBERS = ("world_size", "worker_metadata", "mesh_info", "shutdown", "group")



@dataclass
class WorkerGroups:
    """The worker groups a step talks to (None where the role is not configured), each
    behind its typed proxy.

    ``resource_pools`` are released when the groups shut down. ``rollout``: the standalone
    rollout group of split placement (:class:`~megaflow.workers.rollout_worker.RolloutWorker`;
    None: the engines live in the actor's processes). ``actor_is_reference``: the actor's
    frozen base (LoRA, adapters disabled) computes the reference log-probs (:attr:`reference`).
    """

    actor: ActorProxy
    ref: RefProxy | None = None
    critic: CriticProxy | None = None
    reward_model: RewardModelProxy | None = None
    resource_pools: list[ResourcePool] = field(default_factory=list)
    rollout: RolloutProxy | None = None
    cost_critic: CostCriticProxy | None = None
    actor_is_reference: bool = False

    @property
    def reference(self) -> RefProxy | ActorProxy | None:
        """Where the reference log-probs come from: the reference group, or with LoRA (no
        reference group) the actor with its adapters disabled (``actor_is_reference``); None
        when the run uses no reference."""
        return self.ref if self.ref is not None else (self.actor if self.actor_is_reference else None)

    def named(self) -> dict[str, Any]:
        """``{role: group}`` of the configured groups (actor, rollout, ref, critic,
        reward_model), for shutdown and for naming a dead rank."""
        return {name: group for name in ("actor", "rollout", "ref", "critic", "cost_critic", "reward_model")
                if (group := getattr(self, name)) is not None}

__all__ = ["WorkerGroups", "ActorProxy", "RolloutProxy", "RefProxy", "CriticProxy", "CostCriticProxy",
           "RewardModelProxy", "MegatronProxy",
           "RoleProxy", "WorkerGroupLike", "Reads", "reads", "declared_reads", "inputs_for", "FORWARD_KEYS",
           "PROMPT_KEYS", "SAMPLING_META", "GROUP_MEMBERS"]
