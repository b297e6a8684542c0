"""Run a function on N local processes that form one torch.distributed world.

Used by tests and benchmarks to exercise distributed code on CPU (gloo) without Ray:
ranks are forked by a ``forkserver`` (forking the multi-threaded caller itself can deadlock
gloo inside a large pytest session; the server is a fresh single-threaded interpreter that
imported torch, megatron-core and megaflow's model code once, so a rank starts in a fraction
of a second instead of re-importing them for ~4 s), each world rendezvous at a ``TCPStore``
that the calling process serves on a port the kernel picked (so no other process can take
the port between choosing and listening), and a rank that raises makes the whole call raise
with that rank's traceback instead of hanging.

A rank sees the caller's ``os.environ``, ``sys.path`` and working directory as they are at
the call, not as they were when the server started.
"""
from __future__ import annotations

import multiprocessing.forkserver
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megaflow.utils.environ import exported_env


class DistributedRunError(RuntimeError):
    """A rank of :func:`run_distributed` raised or did not finish in time."""


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` (an address of this machine) that was free a moment ago: the
    kernel's choice for a bind to port 0. Another process may take it before it is used."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


# imported once by the forkserver; every rank is forked from it with these already loaded
FORKSERVER_PRELOAD = ("torch", "torch.distributed", "megatron.core", "megatron.core.parallel_state",
                      "megatron.core.tensor_parallel", "transformers", "megaflow.megatron.parallel",
                      "megaflow.megatron.model")
# the server's environment while it starts: OpenBLAS (loaded by numpy) would otherwise start
# a worker thread per extra core at import, and the server must stay single-threaded to fork
_FORKSERVER_START_ENV = {"OPENBLAS_NUM_THREADS": "1"}
# os.environ as the running server was started with (what its preload imports changed is not in it)
_server_start_env: dict[str, str] = {}


def _rank_context() -> tuple[Any, dict[str, str]]:
    """The ``forkserver`` multiprocessing context, its server started (once per process, and
    again if it died) with :data:`FORKSERVER_PRELOAD` imported from the caller's ``sys.path``,
    and the environment the server was started with."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    # Python 3.11's server ignores the sys.path it is handed: give it through PYTHONPATH
    server_env = dict(_FORKSERVER_START_ENV, PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
    running = forkserver_pid()
    with exported_env(server_env):
        start_env = dict(os.environ)
        multiprocessing.forkserver.ensure_running()
    if forkserver_pid() != running:
        _server_start_env.clear()
        _server_start_env.update(start_env)
    return ctx, dict(_server_start_env)


def forkserver_pid() -> int | None:
    """The process id of the server that forks :func:`run_distributed`'s ranks, or None
    before the first call."""
    pid: int | None = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    return pid


def _rank_environ(caller_env: dict[str, str], server_start_env: dict[str, str]) -> dict[str, str]:
    """A rank's environment: the caller's at the call, not the server's at its start, plus
    what the server's preload imports set (as they would have set it importing in the rank)."""
    set_by_imports = {k: v for k, v in os.environ.items() if server_start_env.get(k) != v}
    return {**caller_env, **set_by_imports}


def _entry(rank: int, world_size: int, port: int, environs: tuple[dict[str, str], dict[str, str]],
           fn: Callable, args: tuple, out_dir: str, backend: str, num_threads: int, timeout_s: float) -> None:
    environ = _rank_environ(*environs)
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(num_threads)
    out_path = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore("127.0.0.1", port, None, False, timeout)  # a client of the parent's store
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent with the traceback
        result = ("error", traceback.format_exc())
    try:
        with open(out_path, "wb") as f:
            pickle.dump(result, f)
    except Exception:  # noqa: BLE001 - unpicklable result
        with open(out_path, "wb") as f:
            pickle.dump(("error", "result not picklable:\n" + traceback.format_exc()), f)
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    backend: str = "gloo", timeout_s: float = 300.0,
                    num_threads: int = 1) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes forked by a forkserver.

    The default process group is initialised before ``fn`` runs and destroyed after. Each
    rank sees the caller's ``os.environ``, ``sys.path`` and working directory at this call.
    ``fn`` must be importable (a module-level function) and its return value picklable.

    Args:
        fn: the per-rank function.
        world_size: number of processes (ranks 0..world_size-1).
        *args: extra arguments passed to every rank (pickled).
        backend: torch.distributed backend (``"gloo"`` on CPU).
        timeout_s: wall-clock limit for the whole run, also the collective timeout.
        num_threads: torch intra-op threads per rank (keep 1 on small machines).

    Returns:
        The per-rank return values, index = rank.

    Raises:
        DistributedRunError: naming the first rank that raised (with its traceback), or
            the ranks that did not finish within ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    from megaflow.single_controller.store import open_tcp_store

    # the rendezvous store lives in this process, on a port it already listens on
    store = open_tcp_store("127.0.0.1", 0, None, is_master=True, timeout=timedelta(seconds=timeout_s))
    port = store.port
    ctx, server_start_env = _rank_context()
    environs = (dict(os.environ), server_start_env)
    with tempfile.TemporaryDirectory(prefix="megaflow_dist_") as out_dir:
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, environs, fn, args, out_dir,
                                                   backend, num_threads, timeout_s), daemon=False)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = timeout_s + 60.0  # the collective timeout fires first; this is a backstop
        start = time.monotonic()
        for p in procs:
            p.join(max(1.0, deadline - (time.monotonic() - start)))
        alive = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results: list[Any] = []
        errors: list[str] = []
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: exited with code {procs[r].exitcode} and no result")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r} raised:\n{value}")
                results.append(None)
            else:
                results.append(value)
        if alive:
            errors.insert(0, f"ranks {alive} did not finish within {timeout_s:.0f}s")
        if errors:
            raise DistributedRunError("\n".join(errors))
        return results


__all__ = ["run_distributed", "find_free_port", "forkserver_pid", "DistributedRunError", "FORKSERVER_PRELOAD"]
