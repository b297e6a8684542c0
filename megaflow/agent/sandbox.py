"""A Python interpreter in a sandbox: a separate process with limits, killed at its timeout.

Each call runs the code in a fresh ``python -I -S`` process (:mod:`megaflow.agent._sandbox_child`
starts it) with:

* an empty temporary working directory (removed afterwards), stdout and stderr going to a
  file in it, so a huge output is cut by the file-size limit instead of filling memory;
* resource limits (``setrlimit``): CPU seconds (``RLIMIT_CPU``: SIGXCPU, then SIGKILL a second
  later), address space (``RLIMIT_AS``: allocations beyond it raise ``MemoryError``), file
  size (``RLIMIT_FSIZE``), process count (``RLIMIT_NPROC``), no core files, 64 open files;
* no network: a new network namespace (``unshare(CLONE_NEWNET)``, plus ``CLONE_NEWUSER`` when
  not root) holding only a down loopback device. Where namespaces are not allowed
  (:func:`network_namespace_available` is False: containers without user namespaces,
  non-Linux), sockets are refused by the audit hook instead, which a determined program
  can get around through a C extension; run such hosts' sandboxes in a container without
  network;
* its own identity when the host runs as root: a uid/gid of its own (no account needed),
  so files outside world-writable directories cannot be written, ``RLIMIT_NPROC`` counts
  exactly this sandbox's processes, and after the call every process with that uid is
  killed. Not as root, the sandbox runs as the caller's user in a user namespace and
  the process group is killed;
* an audit hook (PEP 578) refusing writes outside the working directory (the only way to
  keep it out of world-writable ``/tmp``), fork/exec/spawn/``os.system`` and ``ctypes``.
  Audit hooks are not a security boundary on their own; here they sit behind the
  separate uid, the limits and the namespace.
* a wall-clock timeout after which the whole process group (and, as root, every process
  of the sandbox uid) is killed with SIGKILL.

A mount namespace with a read-only root would be the stronger write barrier; it is not
used because it needs root and a remount of every submount.
"""
from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from megaflow.agent.tool import Tool, ToolError

_CHILD_SOURCE = (Path(__file__).parent / "_sandbox_child.py").read_text()
#: first uid of the range sandbox uids are drawn from (as root); well above any account.
SANDBOX_UID_BASE = 1_800_000_000
_NETNS_FAILED = 70
WORKDIR_PREFIX = "megaflow-sandbox-"


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one sandboxed run (all enforced by the kernel except ``timeout_s``)."""

    timeout_s: float = 10.0  # wall clock, then SIGKILL
    cpu_s: int = 5  # RLIMIT_CPU
    memory_bytes: int = 512 << 20  # RLIMIT_AS
    file_bytes: int = 1 << 20  # RLIMIT_FSIZE: each file, the captured output too
    num_processes: int = 4  # RLIMIT_NPROC (per sandbox uid when root)
    max_output_chars: int = 2000  # of the captured output shown to the model (its end)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0, got {value!r}")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of :func:`run_python`.

    Attributes:
        output: stdout and stderr interleaved, at most ``max_output_chars`` (the end).
        error: None on exit status 0, else one of ``"timeout"``, ``"cpu_time"``,
            ``"output_limit"``, ``"memory"``, ``"killed"``, ``"exit_status"``.
        returncode: the child's exit status (negative: killed by that signal).
        seconds: wall-clock seconds.
    """

    output: str
    error: str | None
    returncode: int
    seconds: float


@functools.lru_cache(maxsize=1)
def network_namespace_available() -> bool:
    """Whether this host lets the sandbox make a network namespace (checked once per process)."""
    if sys.platform != "linux":
        return False
    result = _run("pass", SandboxLimits(timeout_s=20), network_namespace=True)
    return result.returncode != _NETNS_FAILED


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter and return what it printed.

    Never raises for anything the code does; see the module docstring for the limits.
    """
    return _run(code, limits, network_namespace=network_namespace_available())


def _run(code: str, limits: SandboxLimits, network_namespace: bool) -> SandboxResult:
    as_root = os.geteuid() == 0
    uid = SANDBOX_UID_BASE + secrets.randbelow(100_000_000) if as_root else None
    workdir = tempfile.mkdtemp(prefix=WORKDIR_PREFIX)
    out_path = os.path.join(workdir, ".output")
    config = {"cpu_s": limits.cpu_s, "memory_bytes": limits.memory_bytes, "file_bytes": limits.file_bytes,
              "num_processes": limits.num_processes, "network_namespace": network_namespace, "uid": uid,
              "workdir": workdir}  # in the command line: live_sandbox_processes() finds the run by it
    start = time.monotonic()
    try:
        with open(out_path, "wb") as out:
            if uid is not None:
                os.chown(workdir, uid, uid)
                os.chown(out_path, uid, uid)
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _CHILD_SOURCE, json.dumps(config)],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, cwd=workdir,
                env={"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
                start_new_session=True)
            timed_out = _feed_and_wait(proc, code, limits.timeout_s)
        seconds = time.monotonic() - start
        output_bytes = os.path.getsize(out_path)
        output = _tail(out_path, limits.max_output_chars)
    finally:
        _kill_everything(proc if "proc" in locals() else None, uid)
        shutil.rmtree(workdir, ignore_errors=True)
    error = _classify(proc.returncode, timed_out, output, output_bytes >= limits.file_bytes)
    return SandboxResult(output=output, error=error, returncode=proc.returncode, seconds=seconds)


def _feed_and_wait(proc: subprocess.Popen, code: str, timeout_s: float) -> bool:
    """Send the code, wait up to ``timeout_s``; True if the child had to be killed."""
    if proc.stdin is None:
        raise ValueError("the sandbox child must be started with stdin=subprocess.PIPE")
    try:
        proc.stdin.write(code.encode())
        proc.stdin.close()
    except BrokenPipeError:
        pass
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def _kill_everything(proc: subprocess.Popen | None, uid: int | None) -> None:
    """SIGKILL the child's process group and (as root) every process of the sandbox uid."""
    if proc is not None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    if uid is not None:
        for pid in processes_of_uid(uid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def processes_of_uid(uid: int) -> list[int]:
    """Ids of the live processes whose real uid is ``uid`` (from ``/proc``)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("Uid:"):
                if int(line.split()[1]) == uid:
                    pids.append(int(entry))
                break
    return pids


def live_sandbox_processes() -> list[int]:
    """Ids of live sandbox processes of this host (their command line names a sandbox workdir)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and WORKDIR_PREFIX.encode() in Path(f"/proc/{entry}/cmdline").read_bytes():
                pids.append(int(entry))
        except OSError:
            continue
    return pids


def _tail(path: str, max_chars: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4 * max_chars))
        text = f.read().decode("utf-8", errors="replace")
    return text[-max_chars:]


def _classify(returncode: int, timed_out: bool, output: str, output_full: bool) -> str | None:
    if timed_out:
        return "timeout"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_time" if returncode == -signal.SIGXCPU else "killed"
    if output_full:
        return "output_limit"
    if returncode == 0:
        return None
    return "memory" if "MemoryError" in output else "exit_status"


class PythonInterpreter(Tool):
    """``python(code)``: run a Python program in the sandbox; the observation is what it printed."""

    name = "python"
    description = "Run a Python 3 program and return what it prints (no network, no files outside its folder)."
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "a complete Python program"}},
                  "required": ["code"]}

    def __init__(self, **limits: Any):
        self.limits = SandboxLimits(**limits)
        # the sandbox kills the child itself; run_tool_call's own timeout is only a backstop
        self.timeout_s = self.limits.timeout_s + 10.0

    def call(self, args: Mapping[str, Any]) -> str:
        result = run_python(args["code"], self.limits)
        if result.error is not None:
            raise ToolError(f"{result.error} (exit status {result.returncode})\n{result.output}".rstrip(),
                            kind=result.error)
        return result.output
