"""open_tcp_store: a master on a loopback address listens there only; elsewhere torch's socket."""
import os
from datetime import timedelta

import psutil
import pytest

from megaflow.single_controller.store import is_loopback, open_tcp_store


def _listening_ports() -> dict[int, str]:
    me = os.getpid()
    return {c.laddr.port: c.laddr.ip for c in psutil.net_connections(kind="inet")
            if c.pid == me and c.status == psutil.CONN_LISTEN}


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_loopback_master_listens_on_loopback_only(host):
    master = open_tcp_store(host, 0, 2, is_master=True, timeout=timedelta(seconds=30))
    assert _listening_ports()[master.port] == "127.0.0.1"
    client = open_tcp_store(host, master.port, 2, is_master=False, timeout=timedelta(seconds=30))
    client.set("key", "value")
    assert master.get("key") == b"value"


def test_a_routable_master_keeps_torchs_socket():
    # What a cluster's rank 0 gets: torch's own listener, on every interface.
    master = open_tcp_store("0.0.0.0", 0, 1, is_master=True, timeout=timedelta(seconds=30))
    assert _listening_ports()[master.port] in ("::", "0.0.0.0")


@pytest.mark.parametrize("host, expected", [("127.0.0.1", True), ("127.1.2.3", True), ("::1", True),
                                            ("localhost", True), ("10.0.0.1", False), ("node-1", False)])
def test_is_loopback(host, expected):
    assert is_loopback(host) is expected


def test_a_reserved_port_is_held_until_the_master_store_serves_on_it():
    import socket

    from megaflow.single_controller import store as store_mod

    port = store_mod.reserve_port("127.0.0.1")
    assert _listening_ports()[port] == "127.0.0.1"  # held from the moment it is chosen
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))  # nobody else can take it meanwhile
    master = open_tcp_store("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30))
    assert master.port == port and port not in store_mod._RESERVED
    client = open_tcp_store("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
    client.set("key", "value")
    assert master.get("key") == b"value"
