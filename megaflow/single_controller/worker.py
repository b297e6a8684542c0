"""The base class of every role that runs inside a worker group.

A role (actor, critic, reference, reward model, rollout) subclasses :class:`Worker`, marks
the methods the controller calls with ``@register`` and, for ``nd_compute`` dispatch,
registers its place in each named mesh with :meth:`Worker.register_dp_info`.

The worker group sets the standard ``torch.distributed`` environment in every rank's
process before the role objects are built:

* ``RANK``, ``WORLD_SIZE``: global rank and size of the group;
* ``LOCAL_RANK``: the rank's CUDA device index (0 when Ray made one GPU visible; without
  CUDA the node index), and ``MEGAFLOW_NODE_LOCAL_RANK``: index of the rank among the
  group's ranks on its node (:mod:`megaflow.utils.device`);
* ``MASTER_ADDR``, ``MASTER_PORT``: rank 0's node IP and a port that was free there.

so :meth:`Worker.init_distributed` (or any ``env://`` initialisation, including
megatron-core's) forms one world over the group. Roles colocated in one process share
that world (the second ``init_distributed`` is a no-op). The same class also works in
processes started by :func:`megaflow.utils.launch.run_distributed`, which sets the same
variables.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megaflow.single_controller.decorator import Dispatch, register
from megaflow.single_controller.dispatch import DPInfo
from megaflow.single_controller.store import open_tcp_store

_ENV_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class WorkerMetadata:
    """Where one rank of a worker group runs (as reported by its process).

    Attributes:
        rank: global rank in the group.
        world_size: number of ranks in the group.
        local_rank: index among the group's ranks on the same node (pool order).
        node_index: index of the node in the resource pool's ``process_on_nodes``.
        node_id: Ray node id.
        node_ip: IP address of the node.
        hostname: host name of the node.
        pid: process id of the rank's Ray actor.
        gpu_ids: accelerator ids Ray assigned to the actor (empty on CPU).
    """

    rank: int
    world_size: int
    local_rank: int
    node_index: int
    node_id: str
    node_ip: str
    hostname: str
    pid: int
    gpu_ids: tuple[str, ...]


def _env(key: str) -> str:
    try:
        return os.environ[key]
    except KeyError:
        raise RuntimeError(f"environment variable {key} is not set: a Worker must be built inside a worker group "
                           f"(or a process that sets {', '.join(_ENV_KEYS)})") from None


class Worker:
    """Base class of a role: rank, world size, rendezvous and per-mesh dispatch info.

    Subclasses call ``super().__init__()`` (optional: every attribute is read lazily).
    """

    def __init__(self) -> None:
        self._dp_infos: dict[str, DPInfo] = {}

    @property
    def rank(self) -> int:
        """Global rank in the worker group."""
        return int(_env("RANK"))

    @property
    def world_size(self) -> int:
        """Number of ranks in the worker group."""
        return int(_env("WORLD_SIZE"))

    @property
    def local_rank(self) -> int:
        """``$LOCAL_RANK``: the CUDA device index (the node index without CUDA; 0 when unset)."""
        return int(os.environ.get("LOCAL_RANK", "0"))

    @property
    def master_addr(self) -> str:
        """Rendezvous host: rank 0's node IP."""
        return _env("MASTER_ADDR")

    @property
    def master_port(self) -> int:
        """Rendezvous TCP port on rank 0's node."""
        return int(_env("MASTER_PORT"))

    def init_distributed(self, backend: str | None = None, timeout_s: float = 1800.0) -> None:
        """Create the default ``torch.distributed`` process group over the worker group.

        Args:
            backend: ``"gloo"`` or ``"nccl"``; default NCCL when CUDA is available, else gloo.
                With NCCL the current CUDA device becomes the first one Ray made visible.
            timeout_s: collective timeout in seconds.

        Raises:
            RuntimeError: a process group already exists with a different rank or size.
        """
        if dist.is_initialized():
            if dist.get_rank() != self.rank or dist.get_world_size() != self.world_size:
                raise RuntimeError(f"a process group already exists as rank {dist.get_rank()} of "
                                   f"{dist.get_world_size()}, this worker is rank {self.rank} of {self.world_size}")
            return
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(0)
        timeout = timedelta(seconds=timeout_s)
        store = open_tcp_store(self.master_addr, self.master_port, self.world_size, is_master=self.rank == 0,
                               timeout=timeout)  # rank 0's listens on loopback only on a one-node run
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world_size, timeout=timeout)

    def register_dp_info(self, mesh: str, dp_rank: int, is_collect: bool) -> None:
        """Record this rank's place in ``mesh`` for ``nd_compute(mesh)`` dispatch.

        Megatron training meshes: ``dp_rank`` = data-parallel rank, ``is_collect = tp_rank
        == 0 and cp_rank == 0 and pp_rank == pp_size - 1``; generation meshes: ``dp_rank`` =
        replica index, ``is_collect = gen_tp_rank == 0`` (:func:`~megaflow.single_controller.decorator.nd_compute`).
        Register once
        per mesh before the first call; the controller caches the layout.

        Raises:
            ValueError: bad values, or a different registration for the same mesh.
        """
        if not isinstance(mesh, str) or not mesh:
            raise ValueError(f"mesh must be a non-empty string, got {mesh!r}")
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise ValueError(f"dp_rank must be an int >= 0, got {dp_rank!r}")
        if not isinstance(is_collect, bool):
            raise ValueError(f"is_collect must be a bool, got {is_collect!r}")
        infos = self.__dict__.setdefault("_dp_infos", {})
        info = DPInfo(dp_rank, is_collect)
        if infos.get(mesh, info) != info:
            raise ValueError(f"mesh {mesh!r} is already registered on rank {self.rank} as {infos[mesh]}; "
                             f"a mesh layout cannot change (the controller caches it)")
        infos[mesh] = info

    def close(self) -> None:
        """Release what the role holds outside its process's memory (files, directories) before
        the worker group kills the process (:meth:`~megaflow.single_controller.host.WorkerHost.close_roles`:
        ``ray.kill`` ends a process without ``atexit``). The base class holds nothing. An
        override must be idempotent, quick, and safe on a role whose set-up failed half-way."""

    @register(Dispatch.ONE_TO_ALL)
    def get_dp_info(self, mesh: str) -> DPInfo:
        """This rank's :class:`DPInfo` for ``mesh`` (the group returns one per rank).

        Raises:
            KeyError: ``mesh`` was not registered on this rank (the registered ones are listed).
        """
        infos = self.__dict__.get("_dp_infos", {})
        if mesh not in infos:
            raise KeyError(f"mesh {mesh!r} is not registered on {type(self).__name__} rank {self.rank} "
                           f"(registered: {sorted(infos)}); call self.register_dp_info({mesh!r}, dp_rank=..., "
                           f"is_collect=...) before the first nd_compute({mesh!r}) call")
        return infos[mesh]


__all__ = ["Worker", "WorkerMetadata"]
