"""``python -m megaflow.launch.node``: start this node's Ray daemon with megaflow's defaults.

Subcommands (run on the node itself, e.g. through ``srun``)::

    python -m megaflow.launch.node ip [--interface ib0]
    python -m megaflow.launch.node head --port 6379 --num-cpus 64 --num-gpus 8 [--interface ib0]
    python -m megaflow.launch.node worker --address 10.0.0.1:6379 --num-cpus 64 --num-gpus 8

``head`` and ``worker`` replace themselves with ``ray start ... --block`` (so ``srun``
and Slurm's signals reach Ray directly; SIGTERM stops every Ray process of the node).

Ray's worker processes run at nice 0 (:func:`node_env`), not Ray's default 15.

Security defaults: Ray is told the node's *internal* IP (the address of
``--interface``, or the interface of the default route), never a wildcard; the dashboard
is off, and when enabled binds 127.0.0.1 unless ``--dashboard-host`` says otherwise.
Ray's token authentication is required (:mod:`megaflow.launch.auth`): the token comes
from ``RAY_AUTH_TOKEN_PATH`` (the Slurm script writes a per-job file readable only by the
user), ``RAY_AUTH_TOKEN`` or ``~/.ray/auth_token``; ``RAY_AUTH_MODE=disabled`` is the
explicit opt-out. The token is never printed.
"""
from __future__ import annotations

import argparse
import fcntl
import ipaddress
import os
import socket
import struct
import sys
from collections.abc import Mapping

_SIOCGIFADDR = 0x8915  # Linux ioctl: IPv4 address of an interface


def interface_ip(interface: str) -> str:
    """IPv4 address of network interface ``interface`` (Linux).

    Raises:
        ValueError: no such interface, or it has no IPv4 address.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError as err:
            names = ", ".join(name for _, name in socket.if_nameindex())
            raise ValueError(f"interface {interface!r} has no IPv4 address ({err.strerror}); "
                             f"interfaces here: {names}") from None
    return socket.inet_ntoa(packed[20:24])


def default_route_ip() -> str | None:
    """IPv4 address of the interface that routes outward (no packet is sent), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(("10.255.255.255", 1))
            address = sock.getsockname()[0]
        except OSError:
            return None
    return None if ipaddress.ip_address(address).is_loopback or address == "0.0.0.0" else address


def node_ip(interface: str | None = None) -> str:
    """The address Ray should use on this node: ``interface``'s IPv4 when given, else the
    default-route interface's, else a non-loopback address of the host name.

    Raises:
        ValueError: the interface has no IPv4 address, or no non-loopback address exists
            (then pass ``--interface``).
    """
    if interface:
        return interface_ip(interface)
    address = default_route_ip()
    if address:
        return address
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except socket.gaierror:
        infos = []
    for info in infos:
        candidate = str(info[4][0])
        if not ipaddress.ip_address(candidate).is_loopback:
            return candidate
    raise ValueError(f"no non-loopback IPv4 address found on {socket.gethostname()}: pass --interface NAME")


def node_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment variables for a node's Ray daemons (a local Ray's too), read from their
    environment when they start.

    ``RAY_worker_niceness``: Ray starts its worker processes at nice 15 by default
    (``RayConfig`` ``worker_niceness``), below every other process of the machine, so that its
    own daemons stay responsive. megaflow's workers are where a run computes, and at nice 15 any
    other busy process on the machine takes their CPU first: next to one ``yes > /dev/null`` on a
    2-core CPU, ``tools/bench_vs_trl.py``'s 3M one-process step took 9.0-9.9 s against 1.6-1.8 s
    at nice 0. megaflow starts them
    at nice 0, like the controller and every other process; a value already in ``environ``
    (default: this process's environment) is kept.
    """
    env: Mapping[str, str] = os.environ if environ is None else environ
    return {"RAY_worker_niceness": env.get("RAY_worker_niceness", "0")}


def ray_start_command(args: argparse.Namespace, ip: str) -> list[str]:
    """The ``ray start`` command line for ``args`` (``head`` or ``worker``) on address ``ip``."""
    cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats",
           f"--node-ip-address={ip}", f"--num-cpus={args.num_cpus}", f"--num-gpus={args.num_gpus}"]
    if args.temp_dir:
        cmd.append(f"--temp-dir={args.temp_dir}")
    if args.object_store_memory:
        cmd.append(f"--object-store-memory={args.object_store_memory}")
    if args.dashboard_agent_listen_port:
        cmd.append(f"--dashboard-agent-listen-port={args.dashboard_agent_listen_port}")
    if args.command == "head":
        cmd += ["--head", f"--port={args.port}", f"--ray-client-server-port={args.ray_client_server_port}",
                f"--include-dashboard={'true' if args.dashboard else 'false'}"]
        if args.dashboard:
            cmd += [f"--dashboard-host={args.dashboard_host}", f"--dashboard-port={args.dashboard_port}"]
    else:
        cmd.append(f"--address={args.address}")
    return cmd + list(args.ray_args)


def _add_start_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--interface", default=None, help="network interface whose IPv4 Ray uses (e.g. ib0)")
    parser.add_argument("--num-cpus", type=int, required=True, help="CPUs Ray offers on this node")
    parser.add_argument("--num-gpus", type=int, default=0, help="GPUs Ray offers on this node")
    parser.add_argument("--temp-dir", default=None, help="Ray's session directory root on this node")
    parser.add_argument("--object-store-memory", type=int, default=None, help="object store bytes")
    parser.add_argument("--dashboard-agent-listen-port", type=int, default=None)
    parser.add_argument("ray_args", nargs="*", help="further `ray start` options, after --")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m megaflow.launch.node", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ip = sub.add_parser("ip", help="print the IPv4 address Ray would use on this node")
    ip.add_argument("--interface", default=None)
    head = sub.add_parser("head", help="start the Ray head (blocks)")
    _add_start_args(head)
    head.add_argument("--port", type=int, default=6379, help="GCS port")
    head.add_argument("--ray-client-server-port", type=int, default=10001)
    head.add_argument("--dashboard", action="store_true", help="start Ray's dashboard (off by default)")
    head.add_argument("--dashboard-host", default="127.0.0.1", help="dashboard bind address (localhost)")
    head.add_argument("--dashboard-port", type=int, default=8265)
    worker = sub.add_parser("worker", help="start a Ray worker node joining --address (blocks)")
    _add_start_args(worker)
    worker.add_argument("--address", required=True, help="HEAD_IP:PORT of the Ray head")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        ip = node_ip(args.interface)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.command == "ip":
        print(ip)
        return 0
    from megaflow.launch.auth import enable_token_auth

    try:
        secured = enable_token_auth(required=True)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not secured:
        print("warning: RAY_AUTH_MODE=disabled: this Ray node accepts unauthenticated connections", file=sys.stderr)
    cmd = ray_start_command(args, ip)
    os.environ.update(node_env())  # inherited through execv by ray start and its daemons
    print(f"[megaflow] {socket.gethostname()}: ray start ({args.command}) on {ip}", flush=True)
    os.execv(cmd[0], cmd)
    return 1  # unreachable


if __name__ == "__main__":
    sys.exit(main())
