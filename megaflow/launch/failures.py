"""A dead worker process or node, told in terms of the run: node, role and rank.

When a Ray worker node dies (hardware fault, preemption, a killed ``raylet``) or one rank's
process is killed (host OOM, ``kill -9``), Ray raises ``ActorDiedError`` /
``NodeDiedError`` on the controller, and megaflow's worker groups wrap it in a
:class:`~megaflow.single_controller.errors.WorkerError`. Neither says which of the run's
roles and ranks are gone. :func:`worker_lost_error` combines the error with where every
rank runs (:class:`RankProcess`, from the groups' ``worker_metadata``) and with Ray's
node table, and returns a :class:`WorkerLostError` whose message names the dead node(s),
every role and rank they hosted, the rank that failed first, and how to resume::

    try:
        trainer.fit()
    except (WorkerError, RayActorError, NodeDiedError) as err:
        if not is_worker_death(err):
            raise
        raise worker_lost_error(err, placements_of(groups)) from err
"""
from __future__ import annotations

import re
import signal
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megaflow.launch.resources import NodeResources
from megaflow.single_controller.futures import process_gone

#: What the controller prints about resuming from the trainer's checkpoints.
RESUME_HINT = ("the run cannot continue without these ranks; once the cluster is whole again, start it with the "
               "same trainer.output_dir and trainer.resume=auto to continue from the last complete checkpoint")

_DEATH_MARKERS = ("ActorDiedError", "RayActorError", "NodeDiedError", "WorkerCrashedError",
                  "worker process died", "actor died", "node has died", "node died")
#: Text of a survivor's error when a peer of its collective died (gloo, NCCL, sockets).
_PEER_LOST_MARKERS = ("connection reset", "connection closed", "connection refused", "broken pipe",
                      "gloo", "nccl", "timed out", "socket", "processgroup", "distbackenderror")
_IP = re.compile(r"\bip:\s*([0-9a-fA-F:.]+)")
_PID = re.compile(r"\bpid:\s*(\d+)")
_WHERE = re.compile(r"role '([^']+)'.*?\brank (\d+)")  # WorkerGroup.where_of(role, rank)


@dataclass(frozen=True)
class RankProcess:
    """The process of one rank of one role: its node and pid (from
    :class:`~megaflow.single_controller.worker.WorkerMetadata`)."""

    role: str
    rank: int
    node_id: str
    node_ip: str
    hostname: str
    pid: int


class WorkerLostError(RuntimeError):
    """Worker processes of the run died; the message names node(s), roles and ranks.

    Attributes:
        role, rank: the rank whose call failed first (None when unknown).
        dead_nodes: IPs of the run's nodes that Ray reports dead.
        lost: ``{role: [ranks]}`` on the dead nodes (or the one dead process).
    """

    def __init__(self, message: str, role: str | None, rank: int | None, dead_nodes: tuple[str, ...],
                 lost: dict[str, list[int]]) -> None:
        super().__init__(message, role, rank, dead_nodes, lost)
        self.message, self.role, self.rank, self.dead_nodes, self.lost = message, role, rank, dead_nodes, lost

    def __str__(self) -> str:
        return self.message


def placements_of(groups: Mapping[str, Any]) -> list[RankProcess]:
    """Placements of every rank of ``{role: worker group}`` (any object with
    ``worker_metadata``: a list of ``WorkerMetadata`` in rank order)."""
    return [RankProcess(role=role, rank=meta.rank, node_id=meta.node_id, node_ip=meta.node_ip,
                          hostname=meta.hostname, pid=meta.pid)
            for role, group in groups.items() for meta in group.worker_metadata]


def is_worker_death(error: BaseException) -> bool:
    """Whether ``error`` reports a dead worker process or node (not a Python exception
    raised by worker code)."""
    try:
        from ray.exceptions import NodeDiedError, RayActorError, WorkerCrashedError

        if isinstance(error, (RayActorError, NodeDiedError, WorkerCrashedError)):
            return True
    except ImportError:  # pragma: no cover - ray is a core dependency
        pass
    text = _error_text(error)
    return any(marker in text for marker in _DEATH_MARKERS)


def _first_line(error: BaseException) -> str:
    """The last non-empty line of the error's remote traceback (the exception), else its text."""
    lines = [ln.strip() for ln in str(getattr(error, "remote_traceback", "") or error).splitlines() if ln.strip()]
    text = lines[-1] if lines else type(error).__name__
    return text if len(text) <= 160 else text[:157] + "..."


def _error_text(error: BaseException) -> str:
    return " ".join(str(part) for part in (error, getattr(error, "remote_traceback", "")))


def _ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"``."""
    out: list[str] = []
    run: list[int] = []
    for rank in sorted(set(ranks)):
        if run and rank == run[-1] + 1:
            run.append(rank)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [rank]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def _by_role(placements: Iterable[RankProcess]) -> dict[str, list[int]]:
    lost: dict[str, list[int]] = {}
    for p in placements:
        lost.setdefault(p.role, []).append(p.rank)
    return {role: sorted(ranks) for role, ranks in lost.items()}


def _describe_ranks(lost: Mapping[str, Sequence[int]]) -> str:
    return "; ".join(f"{role} rank{'s' if len(r) > 1 else ''} {_ranges(r)}" for role, r in lost.items())


def _ray_nodes() -> list[NodeResources] | None:
    try:
        import ray

        if ray.is_initialized():
            return [NodeResources.from_ray(entry) for entry in ray.nodes()]
    except Exception:  # noqa: BLE001 - the head itself may be gone: report what the error says
        return None
    return None


def _dead_actor_processes() -> set[tuple[str, int]] | None:
    """``{(node_id, pid)}`` of this job's actors that Ray's control store (GCS) reports
    DEAD, or None when it cannot be asked."""
    try:
        import ray
        from ray._private import state  # the GCS actor table; ray.util.state needs the dashboard

        if not ray.is_initialized():
            return None
        table = state.actors()
    except Exception:  # noqa: BLE001 - the head may be gone; other evidence is used then
        return None
    return {(info["Address"]["NodeID"], int(info["Pid"])) for info in table.values()
            if info.get("State") == "DEAD" and info.get("Pid")}


def dead_placements(placements: Sequence[RankProcess]) -> list[RankProcess]:
    """The ranks whose process is dead: Ray's actor table says so, or the process ran on
    this machine and is gone. Ordered by role (as given) then rank.

    A survivor's error (a collective whose peer vanished) reaches the controller as an
    ordinary worker exception; asking who is dead names the rank that actually died.
    """
    import socket

    dead = _dead_actor_processes() or set()
    here = {socket.gethostname()}
    out = [p for p in placements
           if (p.node_id, p.pid) in dead or (p.pid and p.hostname in here and process_gone(p.pid))]
    return out


def _looks_like_lost_peer(error: BaseException) -> bool:
    text = _error_text(error).lower()
    return any(marker in text for marker in _PEER_LOST_MARKERS)


def find_dead_ranks(error: BaseException, placements: Sequence[RankProcess], *, wait_s: float = 15.0,
                    poll_s: float = 0.5) -> list[RankProcess]:
    """The dead ranks behind ``error``, if any (see :func:`dead_placements`).

    When none is dead yet but ``error`` reports a worker death or a lost collective peer
    (connection reset, gloo/NCCL errors, timeouts), asks again every ``poll_s`` seconds for
    up to ``wait_s``: Ray learns of a killed process a moment after its peers do. Other
    errors (a Python exception in worker code) are answered at once.
    """
    deadline = time.monotonic() + wait_s
    patient = is_worker_death(error) or _looks_like_lost_peer(error)
    while True:
        dead = dead_placements(placements)
        if dead or not patient or time.monotonic() >= deadline:
            return dead
        time.sleep(poll_s)


def _failed_rank(error: BaseException, placements: Sequence[RankProcess]) -> RankProcess | None:
    role, rank = getattr(error, "role", None), getattr(error, "rank", None)
    where = _WHERE.search(str(getattr(error, "where", "") or ""))
    if (role is None or rank is None) and where:
        role, rank = where.group(1), int(where.group(2))
    if role is not None and rank is not None:
        return next((p for p in placements if p.role == role and p.rank == rank), None) or \
            RankProcess(role=role, rank=rank, node_id="", node_ip="?", hostname="", pid=0)
    text = _error_text(error)
    pids, ips = {int(m) for m in _PID.findall(text)}, set(_IP.findall(text))
    return next((p for p in placements if p.pid in pids and (not ips or p.node_ip in ips)), None)


def worker_lost_error(error: BaseException, placements: Sequence[RankProcess],
                      nodes: Sequence[NodeResources] | None = None, resume_hint: str = RESUME_HINT,
                      method: str | None = None, dead: Sequence[RankProcess] | None = None) -> WorkerLostError:
    """Explain a dead worker process or node in terms of the run.

    Args:
        error: what the controller caught: a ``WorkerError`` (role and rank known), a Ray
            ``ActorDiedError`` (its text carries the dead actor's ``ip`` and ``pid``), or a
            ``NodeDiedError``.
        placements: every rank of every role (:func:`placements_of`).
        nodes: Ray's node table; default ``ray.nodes()`` when connected (None when the
            head is unreachable: the message then relies on the error alone).
        resume_hint: the last sentence (how to resume).
        method: the worker method that was running, when the error does not say.
        dead: the ranks known to be dead (:func:`find_dead_ranks`); the first one is named
            as the rank that died, even when ``error`` came from a surviving peer.

    Returns:
        A :class:`WorkerLostError` to raise (``raise ... from error``).
    """
    nodes = _ray_nodes() if nodes is None else list(nodes)
    reporter = _failed_rank(error, placements)
    failed = dead[0] if dead else reporter
    method = method or getattr(error, "method", None)
    run_nodes = {p.node_id for p in placements} | {p.node_ip for p in placements}
    dead_nodes = [n for n in (nodes or []) if not n.alive and (n.node_id in run_nodes or n.ip in run_nodes)]
    dead_ids = {n.node_id for n in dead_nodes} | {n.ip for n in dead_nodes}
    lines = []
    if failed is not None:
        where = f"node {failed.node_ip}" + (f" ({failed.hostname})" if failed.hostname else "")
        pid = f", pid {failed.pid}" if failed.pid else ""
        during = f" during {method}" if method else ""
        lines.append(f"worker lost: role {failed.role!r} rank {failed.rank} ({where}{pid}) died{during}")
        others = [p for p in (dead or [])[1:] if p.pid != failed.pid]
        if others:
            lines.append(f"also dead: {_describe_ranks(_by_role(others))}")
        if reporter is not None and dead and (reporter.role, reporter.rank) not in {(p.role, p.rank) for p in dead}:
            lines.append(f"(role {reporter.role!r} rank {reporter.rank}, which survived, reported it first: "
                         f"{_first_line(error)})")
    else:
        lines.append(f"worker lost: a worker process of the run died ({type(error).__name__})")
    if dead_nodes:
        lost_here = [p for p in placements if p.node_id in dead_ids or p.node_ip in dead_ids]
        lost = _by_role(lost_here)
        for node in dead_nodes:
            on_node = _by_role(p for p in lost_here if p.node_id == node.node_id or p.node_ip == node.ip)
            host = f" ({node.hostname})" if node.hostname and node.hostname != node.ip else ""
            lines.append(f"node {node.ip}{host} is dead; it ran {_describe_ranks(on_node) or 'no ranks of the run'}")
    elif failed is not None:  # one process: every role colocated in it is gone
        same = [p for p in placements if failed.pid and p.pid == failed.pid and p.node_ip == failed.node_ip]
        lost = _by_role(same + [p for p in (dead or []) if p not in same] or [failed])
        if nodes is not None:
            lines.append(f"its node {failed.node_ip} is alive: the process was killed or crashed (host out of "
                         "memory, a signal, a native crash); see that node's Ray logs (raylet.out, worker logs)")
    else:
        lost = {}
    lines.append(resume_hint)
    return WorkerLostError("\n".join(lines), role=failed.role if failed else None,
                           rank=failed.rank if failed else None, dead_nodes=tuple(n.ip for n in dead_nodes), lost=lost)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the controller's main thread where Ctrl-C raises KeyboardInterrupt, so
    that both unwind the same way (worker groups and Ray stopped, nothing half-written)."""


#: Set once this process received SIGTERM: a library between the signal and the controller
#: (Ray's ``get``, say) may catch the :class:`Terminated` and raise a plain KeyboardInterrupt.
_SIGTERM_RECEIVED = threading.Event()


def sigterm_received() -> bool:
    """Whether this process has received SIGTERM (since :func:`stop_cleanly_on_sigterm`)."""
    return _SIGTERM_RECEIVED.is_set()


def _raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one stop: a second SIGTERM must not cut the clean-up short
    _SIGTERM_RECEIVED.set()
    raise Terminated()


def stop_cleanly_on_sigterm(reset: bool = True) -> Any:
    """Make SIGTERM raise :class:`Terminated` in this process's main thread (a no-op elsewhere).
    Call it again after ``ray.init``, which installs its own handler (``sys.exit(15)``).

    Args:
        reset: forget a SIGTERM received before (:func:`sigterm_received`): a new run in this
            process; False when re-installing the handler within one run.

    Returns:
        The handler it replaced (for ``signal.signal`` to restore), or None off the main thread.
    """
    if threading.current_thread() is not threading.main_thread():
        return None
    if reset:  # a new run in this process (False: re-installing it after ray.init, within one run)
        _SIGTERM_RECEIVED.clear()
    return signal.signal(signal.SIGTERM, _raise_terminated)


#: Exit codes of a run stopped by a signal: 128 + the signal's number, as a shell reports it.
EXIT_SIGINT, EXIT_SIGTERM = 128 + signal.SIGINT, 128 + signal.SIGTERM


def exit_code_of(interrupt: BaseException) -> int:
    """143 for a :class:`Terminated` (or a :class:`RunInterrupted` by SIGTERM, or any interrupt
    once this process received SIGTERM), else 130."""
    by_sigterm = isinstance(interrupt, Terminated) or getattr(interrupt, "by_sigterm", False) or sigterm_received()
    return EXIT_SIGTERM if by_sigterm else EXIT_SIGINT


class RunInterrupted(Exception):
    """The user interrupted the run (Ctrl-C, or SIGTERM with ``by_sigterm``); the message says
    where it stopped and how to go on.

    Attributes:
        step: the last completed step.
        checkpoint: the newest complete checkpoint, or None.
        by_sigterm: stopped by SIGTERM rather than Ctrl-C.
    """

    def __init__(self, step: int, checkpoint: Any = None, by_sigterm: bool = False) -> None:
        super().__init__(step, checkpoint, by_sigterm)
        self.step, self.checkpoint, self.by_sigterm = step, checkpoint, by_sigterm

    def __str__(self) -> str:
        what = "stopped by SIGTERM" if self.by_sigterm else "interrupted"
        if self.checkpoint is None:
            return (f"{what} after step {self.step}; no checkpoint was complete yet, so a restart begins at "
                    "step 0 (trainer.save_freq sets how often one is saved)")
        return (f"{what} after step {self.step}; the newest checkpoint is {self.checkpoint}: start again "
                "with the same trainer.output_dir and trainer.resume=auto to continue from it")


__all__ = ["RankProcess", "WorkerLostError", "placements_of", "is_worker_death", "worker_lost_error",
           "dead_placements", "find_dead_ranks", "RunInterrupted", "RESUME_HINT",
           "Terminated", "stop_cleanly_on_sigterm", "exit_code_of", "EXIT_SIGINT", "EXIT_SIGTERM"]
