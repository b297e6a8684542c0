"""A watchdog process that cleans up after the controller, however the controller ends.

The controller starts it (:meth:`Watchdog.start`) and holds the write end of its stdin; the
kernel closes that end when the controller exits for any reason (``kill -9`` included), and
the watchdog then:

* stops every process started under the local Ray's own processes (:meth:`Watchdog.track`:
  gcs, raylet, ... and what they started: ``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``,
  the workers and their engines) with SIGTERM, then SIGKILL after a grace period. Ray's
  head processes die with the driver (Ray sets ``PR_SET_PDEATHSIG`` on them), but their
  children are re-parented and outlive them by 20 s or more; so the watchdog keeps a
  snapshot of the whole tree (pid and start time, so that a reused pid is never killed),
  refreshed every ``POLL_S`` seconds while the controller lives;
* removes the controller's temporary directories (``<tmp>/megaflow-*-<controller pid>-*``,
  :func:`temp_prefix`).

It runs as a script (``python watchdog.py``: the standard library and psutil only, no
megaflow import, about 0.1 s to start), in its own session so that Ctrl-C in the terminal does not stop it first.
"""
from __future__ import annotations

import glob
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile

#: Seconds between two snapshots of the tracked process tree.
POLL_S = 0.5
#: Seconds between SIGTERM and SIGKILL of what is left.
GRACE_S = 3.0


def temp_prefix(kind: str, pid: int | None = None) -> str:
    """The prefix of a temporary directory that the watchdog of process ``pid`` (default:
    this one) removes when that process ends: ``megaflow-<kind>-<pid>-``."""
    return f"megaflow-{kind}-{os.getpid() if pid is None else pid}-"


class Watchdog:
    """The controller's handle on its watchdog process (see the module docstring)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._proc = proc

    @classmethod
    def start(cls) -> Watchdog:
        """Start the watchdog of this process."""
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), tempfile.gettempdir()],
                                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        return cls(proc)

    def track(self, pids) -> None:
        """Stop these processes and every process they start once the controller ends."""
        if self._proc.stdin is None:
            return
        for pid in pids:
            self._proc.stdin.write(f"{int(pid)}\n".encode())
        self._proc.stdin.flush()

    def close(self, timeout_s: float = 30.0) -> None:
        """The controller's normal end: clean up now and wait for the watchdog to finish."""
        if self._proc.stdin is not None:
            self._proc.stdin.close()
            self._proc.stdin = None
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pass


def local_ray_pids() -> list[int]:
    """The pids of the processes the local Ray started in this process (gcs, raylet, ...)."""
    import ray._private.worker as ray_worker

    node = getattr(ray_worker, "_global_node", None)
    if node is None:
        return []
    return [proc.pid for _, proc in node.live_processes()]


# --------------------------------------------------------------------------- the watchdog process


def _tree(psutil, roots: set[int]) -> dict[int, float]:
    """pid -> start time of the roots and all their descendants that are alive now."""
    found: dict[int, float] = {}
    for pid in roots:
        try:
            proc = psutil.Process(pid)
            for p in [proc, *proc.children(recursive=True)]:
                found[p.pid] = p.create_time()
        except psutil.Error:
            continue
    return found


def _stop(psutil, snapshot: dict[int, float]) -> None:
    procs = []
    for pid, started in snapshot.items():
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == started:  # the same process, not a reused pid
                procs.append(proc)
        except psutil.Error:
            continue
    for sig, wait_s in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, 1.0)):
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                pass
        _, procs = psutil.wait_procs(procs, timeout=wait_s)
        if not procs:
            return


def _watch(controller: int, tmp: str) -> None:
    import psutil

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    roots: set[int] = set()
    snapshot: dict[int, float] = {}
    buffered = b""
    fd = sys.stdin.fileno()
    while True:
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if ready:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            roots.update(int(line) for line in lines if line.strip())
        snapshot.update(_tree(psutil, roots))
    snapshot.update(_tree(psutil, roots))
    _stop(psutil, snapshot)
    for path in glob.glob(os.path.join(tmp, f"megaflow-*-{controller}-*")):
        shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), sys.argv[2])
