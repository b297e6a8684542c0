"""The ``torch.distributed.TCPStore`` of a worker group, listening where its address says.

A master ``TCPStore`` listens on every interface (``*:PORT``) whatever host it is given.
When the group's rendezvous address is a loopback one (a one-node run: the local Ray
binds 127.0.0.1, :mod:`megaflow.launch.local`), :func:`open_tcp_store` binds the master's
socket to that address itself and hands it to the store (``master_listen_fd``), so that
nothing of a local run listens beyond loopback; on a cluster the store keeps torch's own
socket, which the other nodes reach.
"""
from __future__ import annotations

import ipaddress
import socket
from datetime import timedelta

import torch.distributed as dist


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a literal loopback address (127.0.0.0/8, ::1) or ``localhost``."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(("127.0.0.1" if host == "localhost" else host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def open_tcp_store(host: str, port: int, world_size: int | None, *, is_master: bool,
                   timeout: timedelta) -> dist.TCPStore:
    """A ``TCPStore`` at ``host:port``: the server (``is_master``) or a client.

    Args:
        port: 0 with ``is_master`` picks a free port (``store.port`` tells which).
        world_size: members that will connect (None: not known, no wait for them).

    Raises:
        OSError: the master cannot bind ``host:port``.
    """
    if not (is_master and is_loopback(host)):
        return dist.TCPStore(host, port, world_size, is_master, timeout, wait_for_workers=False)
    sock = _listening_socket(host, port)
    return dist.TCPStore(host, sock.getsockname()[1], world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


__all__ = ["is_loopback", "open_tcp_store"]
