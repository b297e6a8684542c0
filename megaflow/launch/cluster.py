"""Waiting for a Ray cluster to offer what a run needs, with a bounded wait.

Nodes of a multi-node Ray cluster join one by one (a Slurm job starts the head, then the
workers; a person starts them by hand). The controller must not start placing worker
groups before the pools fit, and it must not hang when a node never joins. Two waits:

* :func:`wait_for_port`: the Ray head's GCS port accepts TCP connections (the launch
  script waits for it before starting the workers, which need the head up);
* :func:`wait_for_cluster`: polls ``ray.nodes()`` until the alive nodes can host the
  run's :class:`~megaflow.launch.resources.LaunchRequirements`; on timeout raises
  :class:`ClusterNotReadyError` stating what is needed and what joined.
"""
from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable, Sequence

from megaflow.launch.resources import LaunchRequirements, NodeResources, unmet

#: Seconds between two progress lines while waiting.
PROGRESS_EVERY_S = 30.0


class ClusterNotReadyError(TimeoutError):
    """The Ray cluster did not offer the run's resources within the bounded wait."""


def _check_timeout(timeout_s: float, poll_s: float) -> None:
    for name, value in (("timeout_s", timeout_s), ("poll_s", poll_s)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")


def wait_for_port(host: str, port: int, timeout_s: float, poll_s: float = 0.5) -> None:
    """Block until ``host:port`` accepts a TCP connection.

    Raises:
        ValueError: bad timeout or port.
        ClusterNotReadyError: nothing listened there within ``timeout_s`` seconds.
    """
    _check_timeout(timeout_s, poll_s)
    if not isinstance(port, int) or not 0 < port < 65536:
        raise ValueError(f"port must be an int in 1..65535, got {port!r}")
    deadline, last = time.monotonic() + timeout_s, None
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(poll_s, 5.0)):
                return
        except OSError as err:
            last = err
        if time.monotonic() >= deadline:
            raise ClusterNotReadyError(f"the Ray head at {host}:{port} did not accept connections within "
                                       f"{timeout_s:g} s (last error: {last}); see the head's log")
        time.sleep(poll_s)


def cluster_nodes() -> list[NodeResources]:
    """Every node the connected Ray cluster knows (alive or dead), from ``ray.nodes()``.

    Raises:
        RuntimeError: Ray is not initialised in this process.
    """
    import ray

    if not ray.is_initialized():
        raise RuntimeError("not connected to a Ray cluster: call ray.init(address=...) first")
    return [NodeResources.from_ray(entry) for entry in ray.nodes()]


def describe_joined(nodes: Sequence[NodeResources]) -> list[str]:
    """Lines describing the alive nodes: a total, then one line per node."""
    alive = [n for n in nodes if n.alive]
    cpus, gpus = sum(n.cpus for n in alive), sum(n.gpus for n in alive)
    head = f"{len(alive)} node{'' if len(alive) == 1 else 's'}"
    total = f"{gpus:g} GPUs, {cpus:g} CPUs in all" if gpus else f"{cpus:g} CPUs in all"
    lines = [f"{head} ({total})"] + [f"  {n.describe()}" for n in alive]
    dead = [n for n in nodes if not n.alive]
    if dead:
        lines.append(f"  dead: {', '.join(n.ip for n in dead)}")
    return lines


def not_ready_message(required: LaunchRequirements, nodes: Sequence[NodeResources], waited_s: float,
                      address: str | None = None, hint: str | None = None) -> str:
    """The message of :class:`ClusterNotReadyError`: needed, joined, missing, hint."""
    where = f" at {address}" if address else ""
    lines = [f"the Ray cluster{where} does not offer what run {required.experiment!r} needs "
             f"(waited {waited_s:.0f} s)",
             f"needed: {required.describe()}"]
    lines += [f"  {line}" for line in required.describe_pools()]
    lines.append("joined: " + "\n".join(describe_joined(nodes)))
    lines.append("missing: " + "; ".join(unmet(required, nodes)))
    if hint:
        lines.append(f"hint: {hint}")
    return "\n".join(lines)


def wait_for_cluster(required: LaunchRequirements, timeout_s: float, *, poll_s: float = 1.0,
                     address: str | None = None, hint: str | None = None,
                     progress: Callable[[str], None] | None = print,
                     nodes_fn: Callable[[], list[NodeResources]] = cluster_nodes) -> list[NodeResources]:
    """Poll the connected Ray cluster until its alive nodes can host ``required``.

    Args:
        required: from :func:`megaflow.launch.resources.launch_requirements`.
        timeout_s: longest wait in seconds (``ray.resource_wait_timeout_s``); the wait is
            always bounded.
        poll_s: seconds between two polls.
        address: the cluster's address, only for messages.
        hint: appended to the timeout message (e.g. where the node logs are).
        progress: called with a line when the wait starts, every ~30 s and at the end;
            None for silence.
        nodes_fn: source of the node list (default ``ray.nodes()``; tests pass fakes).

    Returns:
        The nodes seen when the requirement was met.

    Raises:
        ValueError: ``timeout_s`` or ``poll_s`` is not a finite positive number.
        RuntimeError: Ray is not initialised.
        ClusterNotReadyError: still unmet after ``timeout_s``; the message states what
            is needed (per node and per pool), what joined (nodes, CPUs, GPUs) and what
            is missing.
    """
    _check_timeout(timeout_s, poll_s)
    say = progress or (lambda line: None)
    start = time.monotonic()
    say(f"waiting up to {timeout_s:g} s for {required.describe()}")
    next_report = start + PROGRESS_EVERY_S
    while True:
        nodes = nodes_fn()
        if not unmet(required, nodes):
            say(f"cluster ready after {time.monotonic() - start:.0f} s: " + "\n".join(describe_joined(nodes)))
            return nodes
        now = time.monotonic()
        if now - start >= timeout_s:
            raise ClusterNotReadyError(not_ready_message(required, nodes, now - start, address, hint))
        if now >= next_report:
            alive = sum(n.alive for n in nodes)
            say(f"still waiting ({now - start:.0f} s): {alive} of {required.num_nodes} nodes joined; "
                + "; ".join(unmet(required, nodes)))
            next_report = now + PROGRESS_EVERY_S
        time.sleep(min(poll_s, max(0.0, timeout_s - (now - start))))


__all__ = ["ClusterNotReadyError", "wait_for_port", "cluster_nodes", "describe_joined", "not_ready_message",
           "wait_for_cluster", "PROGRESS_EVERY_S"]
