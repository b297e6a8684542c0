"""Start-up of a sandboxed Python child (run as ``python -I -S -c <this file's text> <config json>``).

Read by :mod:`megaflow.agent.sandbox`; never imported. In order: read the code from stdin,
leave the network (``unshare(CLONE_NEWNET)``, with ``CLONE_NEWUSER`` when not root), set
the resource limits, drop to the sandbox's own uid/gid when root, install the audit hook
(after importing the common stdlib modules; writes only inside the working directory; no fork/exec/ctypes; sockets
refused when no
network namespace could be made), then run the code as ``__main__``.
"""
import json
import os
import resource
import sys

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
PATH_EVENTS = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod",
               "os.chown", "os.truncate", "os.utime", "os.chflags", "os.lchflags", "os.mkfifo", "os.mknod",
               "shutil.rmtree", "shutil.move", "shutil.copyfile", "shutil.copymode", "shutil.copystat",
               "shutil.chown"}
BLOCKED_EVENTS = {"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.exec", "os.system", "os.kill",
                  "os.killpg", "subprocess.Popen", "pty.spawn", "ctypes.dlopen", "ctypes.dlsym",
                  "ctypes.dlsym/handle", "ctypes.cdata", "ctypes.call_function", "ctypes.addressof",
                  "ctypes.string_at", "ctypes.wstring_at", "sys.addaudithook", "os.setuid"}
#: imported before the uid is dropped: the interpreter's library may sit in a directory the
#: sandbox uid cannot read (e.g. a pyenv under /root); other modules import if readable.
PRELOADED = ("math", "cmath", "decimal", "fractions", "statistics", "random", "itertools", "functools",
             "collections", "heapq", "bisect", "re", "json", "string", "datetime", "time", "socket",
             "encodings.idna", "traceback")
SOCKET_EVENTS = {"socket.__new__", "socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg",
                 "socket.getaddrinfo", "socket.gethostbyname"}


def leave_network(as_root: bool) -> bool:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWNET if as_root else CLONE_NEWNET | CLONE_NEWUSER
    return libc.unshare(flags) == 0


def set_limits(cfg: dict) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cfg["cpu_s"], cfg["cpu_s"] + 1))
    resource.setrlimit(resource.RLIMIT_AS, (cfg["memory_bytes"], cfg["memory_bytes"]))
    resource.setrlimit(resource.RLIMIT_FSIZE, (cfg["file_bytes"], cfg["file_bytes"]))
    resource.setrlimit(resource.RLIMIT_NPROC, (cfg["num_processes"], cfg["num_processes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))


def audit_hook(workdir: str, block_sockets: bool):
    blocked = BLOCKED_EVENTS | (SOCKET_EVENTS if block_sockets else set())
    realpath, fspath, sep = os.path.realpath, os.fspath, os.sep

    def inside(path) -> bool:
        if isinstance(path, int):
            return True
        path = fspath(path)
        path = path.decode() if isinstance(path, bytes) else path
        full = realpath(path)
        return full == workdir or full.startswith(workdir + sep)

    def hook(event: str, args: tuple) -> None:
        if event in blocked:
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (mode is not None and any(c in str(mode) for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & WRITE_FLAGS)
            if writes and path is not None and not inside(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory")
        elif event in PATH_EVENTS:
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)) and not inside(arg):
                    raise PermissionError(f"sandbox: {event} on {arg!r} outside the working directory")

    return hook


def main() -> None:
    cfg = json.loads(sys.argv[1])
    code = sys.stdin.read()
    sys.stdin.close()
    as_root = os.geteuid() == 0
    in_netns = cfg["network_namespace"] and leave_network(as_root)
    if cfg["network_namespace"] and not in_netns:
        sys.stderr.write("sandbox: could not create a network namespace\n")
        sys.exit(70)
    for module in PRELOADED:
        __import__(module)
    set_limits(cfg)
    if as_root and cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
    workdir = os.path.realpath(os.getcwd())
    sys.addaudithook(audit_hook(workdir, block_sockets=not in_netns))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(code, "<sandbox>", "exec"), namespace)


main()
