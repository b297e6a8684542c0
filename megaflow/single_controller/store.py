"""The ``torch.distributed.TCPStore`` of a worker group, listening where its address says.

A master ``TCPStore`` listens on every interface (``*:PORT``) whatever host it is given.
When the group's rendezvous address is a loopback one (a one-node run: the local Ray
binds 127.0.0.1, :mod:`megaflow.launch.local`), :func:`open_tcp_store` binds the master's
socket to that address itself and hands it to the store (``master_listen_fd``), so that
nothing of a local run listens beyond loopback; on a cluster the store keeps torch's own
socket, which the other nodes reach.

A group's rendezvous port is chosen by rank 0's process before the group's ranks exist
(:meth:`megaflow.single_controller.host.WorkerHost.metadata`). :func:`reserve_port` binds
and listens on it there and then, and :func:`open_tcp_store` hands that very socket to the
master store, so that nothing else on the node (an outgoing gloo connection drawing an
ephemeral port, another run) can take the port in between.
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


#: Listening sockets of :func:`reserve_port`, by port, until :func:`open_tcp_store` takes one.
_RESERVED: dict[int, socket.socket] = {}


def reserve_port(host: str) -> int:
    """A free TCP port on ``host`` (an address of this machine), bound and listening from now on
    in this process: the master :func:`open_tcp_store` of this process on that port takes the
    socket over. Connections that arrive before wait in the socket's backlog.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    sock = _listening_socket(host, 0)
    port = sock.getsockname()[1]
    _RESERVED[port] = sock
    return port


def open_tcp_store(host: str, port: int, world_size: int | None, *, is_master: bool,
                   timeout: timedelta) -> dist.TCPStore:
    """A ``TCPStore`` at ``host:port``: the server (``is_master``) or a client.

    Args:
        port: 0 with ``is_master`` picks a free port (``store.port`` tells which); a port that
            :func:`reserve_port` holds in this process is served on the reserved socket.
        world_size: members that will connect (None: not known, no wait for them).

    Raises:
        OSError: the master cannot bind ``host:port``.
    """
    reserved = _RESERVED.pop(port, None) if is_master and port else None
    if reserved is None and not (is_master and is_loopback(host)):
        return dist.TCPStore(host, port, world_size, is_master, timeout, wait_for_workers=False)
    sock = reserved if reserved is not None else _listening_socket(host, port)
    return dist.TCPStore(host, sock.getsockname()[1], world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


__all__ = ["is_loopback", "open_tcp_store", "reserve_port"]
