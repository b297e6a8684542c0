"""``RayWorkerGroup``: one Ray actor per rank, running any registered worker method by name.

::

    cfg = load_run("tiny_arith_grpo", ["ref.enabled=true", "algorithm.use_kl_loss=true"])
    steps = cfg.trainer.total_steps
    pool = ResourcePool(process_on_nodes=[2])
    actor = RayWorkerGroup(pool, ClassWithInitArgs(ActorWorker, RoleSpec(cfg, "actor", steps)),
                           name_prefix="actor")
    actor.call("init_model")                     # ONE_TO_ALL: runs on every rank
    out = actor.call("compute_log_prob", batch)  # nd_compute("actor"): split by dp rank, collected

Colocated roles share one process per rank (and so its accelerator and its
``torch.distributed`` world)::

    both = create_colocated_worker_cls({"actor": ClassWithInitArgs(ActorWorker, RoleSpec(cfg, "actor", steps)),
                                        "ref": ClassWithInitArgs(RefWorker, RoleSpec(cfg, "ref", steps))})
    groups = RayWorkerGroup(pool, both).spawn()   # {"actor": view, "ref": view}
    groups["ref"].call("compute_ref_log_prob", batch)

The controller does not call groups by name: it holds one typed proxy per role
(:mod:`megaflow.trainer.proxies`), whose methods make these calls.

(``load_run``: :mod:`megaflow.topology`; ``ActorWorker``, ``RefWorker``:
:mod:`megaflow.workers.megatron_workers`, which take the role's
:class:`~megaflow.topology.role_spec.RoleSpec`.)

Start-up costs two parallel round trips: all actors report their metadata (rank 0 also a
free port on its node), then all build their role objects with ``MASTER_ADDR``/
``MASTER_PORT`` set to rank 0's node.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, cast

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from megaflow.single_controller.decorator import MethodSpec, NDCompute, registered_methods
from megaflow.single_controller.dispatch import MeshInfo, check_proto_arguments, collect, make_plan
from megaflow.single_controller.futures import DataProtoFuture, GroupFuture, get_all
from megaflow.single_controller.host import WorkerHost
from megaflow.single_controller.resource_pool import ResourcePool
from megaflow.single_controller.worker import Worker, WorkerMetadata

_RemoteHost = ray.remote(WorkerHost)
logger = logging.getLogger(__name__)
#: Seconds a shutdown waits for the ranks' ``Worker.close`` before it kills them anyway (a rank
#: still busy in a call, a hung collective say, runs the close only after it).
CLOSE_TIMEOUT_S = 5.0


class ClassWithInitArgs:
    """A worker class and the arguments to build it with inside each rank's process.

    Raises:
        TypeError: ``cls`` is not a subclass of :class:`Worker`.
    """

    def __init__(self, cls: type, *args: Any, **kwargs: Any) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Worker)):
            raise TypeError(f"ClassWithInitArgs needs a subclass of megaflow Worker, got {cls!r}")
        self.cls, self.args, self.kwargs = cls, args, kwargs

    def build(self) -> Worker:
        return self.cls(*self.args, **self.kwargs)

    def __repr__(self) -> str:
        return f"ClassWithInitArgs({self.cls.__name__})"


class ColocatedClassWithInitArgs:
    """Several roles built side by side in one process per rank (see :func:`create_colocated_worker_cls`)."""

    def __init__(self, roles: dict[str, ClassWithInitArgs]) -> None:
        self.roles = dict(roles)

    def __repr__(self) -> str:
        return f"ColocatedClassWithInitArgs({ {r: s.cls.__name__ for r, s in self.roles.items()} })"


def create_colocated_worker_cls(class_dict: dict[str, ClassWithInitArgs]) -> ColocatedClassWithInitArgs:
    """Compose several roles into one process per rank (composition, not inheritance).

    Args:
        class_dict: role name -> :class:`ClassWithInitArgs`; role names are identifiers.

    Raises:
        TypeError / ValueError: empty dict, bad role name or value (named).
    """
    if not isinstance(class_dict, dict) or not class_dict:
        raise ValueError(f"create_colocated_worker_cls needs a non-empty dict role -> ClassWithInitArgs, "
                         f"got {class_dict!r}")
    for role, spec in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier():
            raise ValueError(f"role names must be identifiers, got {role!r}")
        if not isinstance(spec, ClassWithInitArgs):
            raise TypeError(f"role {role!r}: expected a ClassWithInitArgs, got {type(spec).__name__}")
    return ColocatedClassWithInitArgs(class_dict)


class _GroupCore:
    """The actors of one group, shared by all role views of it."""

    def __init__(self, pool: ResourcePool, roles: dict[str, ClassWithInitArgs], name_prefix: str) -> None:
        self.pool, self.roles, self.name_prefix = pool, roles, name_prefix
        layout = pool.rank_layout()
        world_size = pool.world_size
        self.hosts: list[ray.actor.ActorHandle] = []
        pool.attach_group()
        self._attached = True
        try:
            for rank, (node, local) in enumerate(layout):
                pg, bundle = pool.bundle_of(rank)
                strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
                host = (_RemoteHost.options(scheduling_strategy=strategy, **pool.actor_resources())
                        .remote(rank, world_size, local, node, pool.actor_threads()))
                # Ray types .remote() as ``ActorHandle[T] | type[T]`` (for its typed-method stubs); it is a handle
                self.hosts.append(cast(ray.actor.ActorHandle, host))
            self.where = [f"group {name_prefix!r} rank {r}" for r in range(world_size)]
            reports = get_all([h.metadata.remote(r == 0) for r, h in enumerate(self.hosts)], self.where, "start-up")
            self.metadata: list[WorkerMetadata] = [meta for meta, _ in reports]
            master_addr, master_port = self.metadata[0].node_ip, reports[0][1]
            get_all([h.init_roles.remote(master_addr, master_port, roles) for h in self.hosts], self.where, "__init__")
        except BaseException:
            self.shutdown(close=False)  # nothing to close yet (roles hold resources from init_model on)
            raise

    def where_of(self, role: str, rank: int) -> str:
        meta = self.metadata[rank]
        return (f"role {role!r} ({self.roles[role].cls.__name__}) rank {rank} "
                f"(node {meta.node_ip}, pid {meta.pid})")

    def shutdown(self, close: bool = True) -> None:
        """Close the roles (:func:`close_hosts`, with ``close``), then kill the ranks' processes."""
        if close and self.hosts:
            close_hosts(self.hosts)
        for host in self.hosts:
            ray.kill(host, no_restart=True)
        self.hosts = []
        if self._attached:
            self.pool.detach_group()
            self._attached = False


def close_hosts(hosts: list[ray.actor.ActorHandle], timeout_s: float = CLOSE_TIMEOUT_S) -> list[str]:
    """Run :meth:`~megaflow.single_controller.host.WorkerHost.close_roles` on every rank, waiting
    at most ``timeout_s`` seconds for all of them; ``ray.kill`` ends a process with ``_exit``
    (no ``atexit``), so this is where a role removes what it keeps outside its memory.

    Returns:
        The failures the ranks reported (also logged as warnings). A rank that died already, or
        did not answer in time, reports nothing: what it left is its own clean-up's to remove
        (the adapter sync's stale directories: :func:`~megaflow.rollout.lora_sync.remove_stale_run_dirs`).
    """
    refs: list[ray.ObjectRef] = [host.close_roles.remote() for host in hosts]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    failures: list[str] = []
    for ref in ready:
        try:
            failures.extend(ray.get(ref))
        except ray.exceptions.RayError:  # the rank is gone already
            continue
    for line in failures:
        logger.warning("%s", line)
    return failures


class RayWorkerGroup:
    """The ranks of one role (or of several colocated roles) as Ray actors.

    :meth:`call` runs any ``@register``-ed method of the role's class as
    ``collect(execute(dispatch(args)))`` (:meth:`submit`: without waiting). A group of
    colocated roles calls nothing itself; :meth:`spawn` returns one view per role.

    Args:
        resource_pool: where the ranks run (one actor per rank, in the pool's rank order).
        cls_with_init_args: :class:`ClassWithInitArgs` (one role) or the result of
            :func:`create_colocated_worker_cls`.
        name_prefix: group name used in errors; for a single role also the role name
            (default: the class name).

    Raises:
        TypeError: a bad ``resource_pool`` or ``cls_with_init_args``.
        WorkerError: a rank's constructor raised (role and rank named).
    """

    def __init__(self, resource_pool: ResourcePool, cls_with_init_args: ClassWithInitArgs | ColocatedClassWithInitArgs,
                 name_prefix: str | None = None) -> None:
        if not isinstance(resource_pool, ResourcePool):
            raise TypeError(f"resource_pool must be a ResourcePool, got {type(resource_pool).__name__}")
        if isinstance(cls_with_init_args, ClassWithInitArgs):
            role = name_prefix or cls_with_init_args.cls.__name__
            roles = {role: cls_with_init_args}
        elif isinstance(cls_with_init_args, ColocatedClassWithInitArgs):
            role, roles = None, cls_with_init_args.roles
        else:
            raise TypeError(f"cls_with_init_args must be a ClassWithInitArgs or create_colocated_worker_cls(...), "
                            f"got {type(cls_with_init_args).__name__}")
        prefix = name_prefix or "+".join(roles)
        self._init_view(_GroupCore(resource_pool, roles, prefix), role)

    @classmethod
    def _view(cls, core: _GroupCore, role: str) -> RayWorkerGroup:
        view = cls.__new__(cls)
        view._init_view(core, role)
        return view

    def _init_view(self, core: _GroupCore, role: str | None) -> None:
        self._core, self._role = core, role
        self._meshes: dict[str, MeshInfo] = {}

    # ------------------------------------------------------------------ properties
    @property
    def role(self) -> str | None:
        """The role this view calls (None for a colocated group before :meth:`spawn`)."""
        return self._role

    @property
    def roles(self) -> list[str]:
        """All roles in this group's processes."""
        return list(self._core.roles)

    @property
    def world_size(self) -> int:
        return len(self._core.metadata)

    @property
    def worker_metadata(self) -> list[WorkerMetadata]:
        """Per-rank :class:`WorkerMetadata`, index = rank."""
        return list(self._core.metadata)

    @property
    def name_prefix(self) -> str:
        return self._core.name_prefix

    def spawn(self, prefix_set: Iterable[str] | None = None) -> dict[str, RayWorkerGroup]:
        """One view per role (all roles by default); views share this group's processes.

        Raises:
            KeyError: an unknown role (the known ones are listed).
        """
        names = list(self._core.roles) if prefix_set is None else list(prefix_set)
        unknown = [r for r in names if r not in self._core.roles]
        if unknown:
            raise KeyError(f"unknown role(s) {unknown}; this group has {list(self._core.roles)}")
        return {r: RayWorkerGroup._view(self._core, r) for r in names}

    def end_startup(self) -> None:
        """End the start-up's garbage-collection pause in every process of this group
        (:meth:`~megaflow.single_controller.host.WorkerHost.end_startup`; for colocated
        roles, the first call does it for all of their views).

        Raises:
            WorkerError: a rank's process failed.
        """
        core = self._core
        get_all([h.end_startup.remote() for h in core.hosts], core.where, "end_startup")

    # ------------------------------------------------------------------ calls
    def mesh_info(self, mesh: str) -> MeshInfo:
        """The cached :class:`MeshInfo` of ``mesh`` (queried from all ranks on first use).

        Raises:
            WorkerError: a rank did not register ``mesh``.
            ValueError: the registered layout is inconsistent (see :class:`MeshInfo`).
        """
        if mesh not in self._meshes:
            role = self._require_role()
            refs = [h.execute.remote(role, "get_dp_info", True, mesh) for h in self._core.hosts]
            where = [self._core.where_of(role, r) for r in range(self.world_size)]
            infos = get_all(refs, where, "get_dp_info")
            self._meshes[mesh] = MeshInfo.from_dp_infos(mesh, infos)
        return self._meshes[mesh]

    def _require_role(self) -> str:
        if self._role is None:
            raise RuntimeError(f"group {self.name_prefix!r} hosts colocated roles {self.roles}; "
                               f"call .spawn() and use one role's view")
        return self._role

    def _spec(self, method: str) -> MethodSpec:
        spec = registered_methods(self._core.roles[self._require_role()].cls).get(method)
        if spec is None:
            raise AttributeError(f"{self._role!r} has no registered method {method!r}")
        return spec

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run the registered ``method``: dispatch the arguments to the ranks, execute, collect.

        Returns:
            The collected value (see :mod:`~megaflow.single_controller.decorator`); a future
            for a method registered with ``blocking=False``.

        Raises:
            AttributeError: ``method`` is not a registered method of this view's role.
            WorkerError: a rank raised or its process died (role and rank named).
        """
        return self._call(method, self._spec(method), args, kwargs)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start the registered ``method`` as :meth:`call` does, without waiting.

        Returns:
            A :class:`~megaflow.single_controller.futures.DataProtoFuture` for proto
            dispatch, a :class:`~megaflow.single_controller.futures.GroupFuture` otherwise;
            ``.get()`` waits and returns what the blocking call would have returned. Either
            can be passed to the next group call (the workers resolve it).

        Raises:
            AttributeError: ``method`` is not a registered method of this view's role.
        """
        return self._call(method, self._spec(method), args, kwargs, blocking=False)

    def _call(self, name: str, spec: MethodSpec, args: tuple[Any, ...], kwargs: dict[str, Any],
              blocking: bool | None = None) -> Any:
        blocking = spec.blocking if blocking is None else blocking
        role = self._require_role()
        method = f"{role}.{name}"
        mode = spec.dispatch_mode
        if spec.is_proto:
            check_proto_arguments(args, kwargs, method)  # before anything is sent, even the mesh query
        mesh = self.mesh_info(mode.mesh) if isinstance(mode, NDCompute) else None
        plan = make_plan(spec, self.world_size, args, kwargs, mesh, put=ray.put, method=method)
        hosts = self._core.hosts
        refs = [hosts[r].execute.remote(role, name, keep, *a, **kw)
                for r, a, kw, keep in zip(plan.ranks, plan.args, plan.kwargs, plan.keep_output, strict=True)]
        where = [self._core.where_of(role, r) for r in plan.ranks]
        collect_index = [plan.ranks.index(r) for r in plan.collect_ranks]
        processes = [(self._core.metadata[r].node_ip, self._core.metadata[r].pid) for r in plan.ranks]
        if not blocking:
            if plan.kind == "proto":
                return DataProtoFuture(refs, where, collect_index, plan.pad_size, plan.num_rows, method)
            return GroupFuture(refs, where, method, single=plan.kind == "single", processes=processes)
        outputs = get_all(refs, where, method, fetch=collect_index, processes=processes)
        return collect(plan, outputs, method)

    def execute_async(self, rank: int, method: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Call ``method`` of this view's role on one rank as is: no dispatch, no collect.

        Any method of the role may be called (registered or not); ``ObjectRef`` arguments
        are resolved by Ray, futures by the worker. For debugging, benchmarks and tools.

        Raises:
            IndexError: ``rank`` is outside the group.
        """
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} is outside group {self.name_prefix!r} of {self.world_size} ranks")
        return self._core.hosts[rank].execute.remote(self._require_role(), method, True, *args, **kwargs)

    def shutdown(self) -> None:
        """Close every role on every rank (:meth:`~megaflow.single_controller.worker.Worker.close`,
        at most :data:`CLOSE_TIMEOUT_S` seconds), kill the group's actors (all roles) and release
        its share of the resource pool."""
        self._core.shutdown()

    def __repr__(self) -> str:
        return f"RayWorkerGroup({self.name_prefix!r}, role={self._role!r}, world_size={self.world_size})"


__all__ = ["RayWorkerGroup", "ClassWithInitArgs", "ColocatedClassWithInitArgs", "create_colocated_worker_cls"]
