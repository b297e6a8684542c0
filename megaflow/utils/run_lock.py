"""One run at a time per run directory: an OS file lock held for the run's life.

``<run dir>/.megaflow.lock`` is locked with ``fcntl.flock`` (exclusive, non-blocking) by the
controller before anything in the run directory is read for resuming or changed (partial
saves removed, checkpoints written), and stays locked until the controller exits; the
kernel releases it when the process ends, however it ends (``kill -9`` included). The file
holds the holder's host, pid and start time (JSON), so a refused run can name it. A lock
file left by a process that no longer holds the lock (it died) is taken over, with a line
that says whose it was.

The descriptor is opened close-on-exec, so processes the controller starts (Ray) do not
inherit the lock and cannot keep it after the controller is gone.
"""
from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

LOCK_FILE = ".megaflow.lock"


class RunDirLockedError(RuntimeError):
    """Another live process holds the run directory's lock (``holder`` describes it)."""

    def __init__(self, run_dir: Path, holder: str) -> None:
        super().__init__(run_dir, holder)
        self.run_dir, self.holder = run_dir, holder

    def __str__(self) -> str:
        return (f"run directory {self.run_dir} is in use by another run ({self.holder}); wait for it to end, "
                "or start this one with another trainer.experiment_name or trainer.output_dir")


def _describe(record: dict) -> str:
    host, pid, since = record.get("host", "?"), record.get("pid", "?"), record.get("time")
    started = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) \
        else ""
    return f"host {host} pid {pid}{started}"


def _read_record(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 4096):
        data += chunk
    try:
        record = json.loads(data.decode() or "{}")
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return record if isinstance(record, dict) else {}


class RunDirLock:
    """The exclusive lock of one run directory (``acquire`` / ``release``, or a ``with`` block).

    Args:
        run_dir: the run directory (created if missing).
        say: where the take-over line of a stale lock goes (default: print).
    """

    def __init__(self, run_dir: str | os.PathLike, say: Callable[[str], None] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._say = say or (lambda line: print(line, flush=True))
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, or refuse.

        Raises:
            RunDirLockedError: another live process holds it (named by host and pid).
        """
        if self._fd is not None:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read_record(fd))
            os.close(fd)
            raise RunDirLockedError(self.run_dir, holder) from None
        previous = _read_record(fd)
        if previous.get("pid") is not None:  # the kernel released it: its holder is gone
            self._say(f"[megaflow] took over the lock of {self.run_dir} left by {_describe(previous)}, which no "
                      "longer runs")
        record = {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        os.fsync(fd)
        self._fd = fd

    def release(self) -> None:
        """Clear the holder record and unlock (a no-op when not held)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            os.ftruncate(fd, 0)  # a later run sees a clean release, not a stale holder
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def __enter__(self) -> RunDirLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()


__all__ = ["RunDirLock", "RunDirLockedError", "LOCK_FILE"]
