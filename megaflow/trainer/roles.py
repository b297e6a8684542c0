"""From a config to running worker groups: pools, colocation, one worker class per role.

Every worker receives the run's frozen config as a
:class:`~megaflow.topology.role_spec.RoleSpec` (config + role name + the run's training
steps) and reads its sections itself; the actor also gets the tokenizer's EOS and padding
ids. Roles placed on the same pool (``resources.placement``) share one Ray actor process
per rank (composed with :func:`~megaflow.single_controller.create_colocated_worker_cls`), so
they share that process's accelerator and torch.distributed world. The rollout lives inside
the actor's processes (:class:`~megaflow.workers.actor_rollout.ActorRolloutWorker`) unless
``resources.placement.rollout`` names a pool of its own: then that pool runs
:class:`~megaflow.workers.rollout_worker.RolloutWorker` processes holding only engines, and
the actor's ranks broadcast their generation shards to them on every weight sync (split
placement).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from megaflow.topology.role_spec import RoleSpec
from megaflow.trainer.proxies import (
    ActorProxy,
    CostCriticProxy,
    CriticProxy,
    MegatronProxy,
    RefProxy,
    RewardModelProxy,
    RoleProxy,
    RolloutProxy,
    WorkerGroups,
)
from megaflow.workers.actor_rollout import ActorRolloutWorker
from megaflow.workers.megatron_workers import CostCriticWorker, CriticWorker, RefWorker, RewardModelWorker

if TYPE_CHECKING:
    from megaflow.config import Config
    from megaflow.single_controller import ClassWithInitArgs, ResourcePool

#: config section -> worker class
ROLE_CLASSES = {"actor": ActorRolloutWorker, "ref": RefWorker, "critic": CriticWorker,
                "reward_model": RewardModelWorker, "cost_critic": CostCriticWorker}
_P = TypeVar("_P", bound=RoleProxy)


def eos_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The tokenizer's end-of-sequence ids as a tuple (HF tokenizers give one id or a list)."""
    eos = tokenizer.eos_token_id
    return tuple(int(i) for i in eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def _role_init_args(cfg: Config, role: str, tokenizer: Any, total_steps: int | None) -> ClassWithInitArgs:
    from megaflow.single_controller import ClassWithInitArgs

    steps = total_steps if total_steps is not None else cfg.trainer.total_steps
    if steps is None:
        raise ValueError("build_worker_groups needs total_steps (the run's training steps) when "
                         "trainer.total_steps is null")
    spec = RoleSpec(cfg, role, steps)
    if role == "actor":
        return ClassWithInitArgs(ROLE_CLASSES[role], spec, eos_token_ids(tokenizer), int(tokenizer.pad_token_id))
    return ClassWithInitArgs(ROLE_CLASSES[role], spec)


def _proxy(views: dict[str, Any], role: str, cls: type[_P]) -> _P | None:
    """The typed proxy ``cls`` over ``role``'s group (None when the role is not configured)."""
    return cls(views[role]) if role in views else None


def resource_pool(cfg: Config, pool_name: str) -> ResourcePool:
    """The :class:`~megaflow.single_controller.ResourcePool` of ``resources.pools.<pool_name>``:
    its nodes and ranks per node, ``resources.num_cpus_per_proc`` CPUs per rank (each rank's
    torch intra-op threads, :meth:`~megaflow.single_controller.ResourcePool.actor_threads`) and
    one GPU per rank with ``resources.use_gpu``."""
    from megaflow.single_controller import ResourcePool

    res = cfg.resources
    return ResourcePool([res.pool_procs_per_node(pool_name)] * res.pool_nodes(pool_name),
                        max_colocate_count=1, use_gpu=bool(res.use_gpu),
                        num_cpus_per_process=res.num_cpus_per_proc, name_prefix=f"megaflow_{pool_name}")


def build_worker_groups(cfg: Config, tokenizer: Any, total_steps: int | None = None) -> WorkerGroups:
    """Create the resource pools and worker groups of every enabled role and initialise
    their models (actor first: its vLLM engines start inside the actor processes). With
    split placement (``resources.placement.rollout``) the actor is a
    :class:`~megaflow.workers.rollout_worker.SplitActorWorker` without engines, a
    :class:`~megaflow.workers.rollout_worker.RolloutWorker` group on the rollout pool holds
    them, and the weight transport between the two is connected
    (:func:`megaflow.trainer.rollout_source.connect_split`).
    ``total_steps``: training steps of the run (the trained roles' LR decay horizon,
    :attr:`~megaflow.topology.role_spec.RoleSpec.lr_decay_steps`); None: ``trainer.total_steps``.
    A rank that fails to start leaves no processes or (named) placement groups behind, so a
    later build in the same Ray session (a retry, the next test) can reuse the names.

    Raises:
        WorkerError: a rank failed to start, naming the role and rank.
    """
    views: dict[str, Any] = {}
    pools: list[ResourcePool] = []
    try:
        _spawn_groups(cfg, tokenizer, total_steps, views, pools)
        return _start_groups(cfg, views, pools)
    except BaseException:
        for view in views.values():
            try:
                view.shutdown()
            except Exception:  # noqa: BLE001 - best effort while the original error propagates
                pass
        for pool in pools:
            pool.remove()
        raise


def _spawn_groups(cfg: Config, tokenizer: Any, total_steps: int | None, views: dict[str, Any],
                  pools: list[ResourcePool]) -> None:
    """Create each pool in use and its worker group, appending to ``pools`` and filling
    ``views`` (role -> group or view of a colocated group) as they come."""
    from megaflow.single_controller import ClassWithInitArgs, RayWorkerGroup, create_colocated_worker_cls
    from megaflow.topology.sizes import pools_in_use, split_rollout_pool
    from megaflow.workers.rollout_worker import RolloutWorker, SplitActorWorker

    split = split_rollout_pool(cfg)
    for pool_name, roles in pools_in_use(cfg).items():  # split placement: ("rollout",) alone on its pool
        pool = resource_pool(cfg, pool_name)
        pools.append(pool)
        members = {role: _role_init_args(cfg, "actor" if role == "rollout" else role, tokenizer, total_steps)
                   for role in roles}
        if split is not None:  # the actor without engines; the engines on their own pool
            for role, cls in (("actor", SplitActorWorker), ("rollout", RolloutWorker)):
                if role in members:
                    members[role] = ClassWithInitArgs(cls, *members[role].args, **members[role].kwargs)
        if len(members) == 1:
            (role, init_args), = members.items()
            views[role] = RayWorkerGroup(pool, init_args, name_prefix=role)
        else:
            group = RayWorkerGroup(pool, create_colocated_worker_cls(members), name_prefix=pool_name)
            views.update(group.spawn(prefix_set=set(members)))


def _start_groups(cfg: Config, views: dict[str, Any], pools: list[ResourcePool]) -> WorkerGroups:
    """The typed proxies over ``views``, with every role's model initialised (and, with split
    placement, the weight transport connected)."""
    from megaflow.topology.sizes import split_rollout_pool

    # Every role's init_model is started before any is awaited: roles on different pools build
    # their process groups and models at the same time; colocated roles share their processes,
    # whose Ray actors run the calls one after another in this order.
    groups = WorkerGroups(actor=ActorProxy(views["actor"]), ref=_proxy(views, "ref", RefProxy),
                          critic=_proxy(views, "critic", CriticProxy),
                          reward_model=_proxy(views, "reward_model", RewardModelProxy), resource_pools=pools,
                          rollout=_proxy(views, "rollout", RolloutProxy),
                          cost_critic=_proxy(views, "cost_critic", CostCriticProxy))
    starting: list[MegatronProxy | RolloutProxy | None] = [groups.actor, groups.rollout, groups.ref, groups.critic,
                                                           groups.cost_critic, groups.reward_model]
    pending = [proxy.init_model_async() for proxy in starting if proxy is not None]
    for future in pending:
        future.get()
    if split_rollout_pool(cfg) is not None:
        from megaflow.hybrid_engine import plan_hybrid_layout
        from megaflow.topology.sizes import role_parallel
        from megaflow.trainer.rollout_source import connect_split

        par = role_parallel(cfg, "actor")
        layout = plan_hybrid_layout(par.tp, par.pp, par.dp, cfg.rollout.tp)  # as the actor plans it
        assert groups.rollout is not None  # (split placement: the rollout role has its own pool, pools_in_use)
        connect_split(groups.actor, groups.rollout, layout, backend="nccl" if cfg.resources.use_gpu else "gloo")
    # The processes' start-up ends here: garbage collection, paused since they started, resumes
    # (a no-op call on the second view of colocated roles).
    for view in views.values():
        view.end_startup()
    groups.actor_is_reference = cfg.actor.lora.rank > 0 and cfg.algorithm.uses_ref
    return groups


def shutdown_worker_groups(groups: WorkerGroups) -> None:
    """Stop every worker process and release the placement groups (idempotent)."""
    for g in groups.named().values():
        try:
            g.shutdown()
        except Exception:  # noqa: BLE001 - best effort at exit; colocated views share one core
            pass
    for pool in groups.resource_pools:
        pool.remove()
    groups.resource_pools.clear()


__all__ = ["build_worker_groups", "shutdown_worker_groups", "eos_token_ids", "ROLE_CLASSES"]
