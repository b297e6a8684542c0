"""`python -m megaflow.launch.node`: the node's address and the `ray start` line."""
import ipaddress
import os
import socket

import pytest

from megaflow.launch.node import interface_ip, main as node_main, node_ip, parse_args, ray_start_command


def test_interface_ip_of_loopback_and_unknown_interface():
    assert interface_ip("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match=r"interface 'nosuch0' has no IPv4 address .*interfaces here: .*lo"):
        interface_ip("nosuch0")


def test_default_node_ip_is_a_local_non_loopback_address():
    ip = node_ip()
    assert not ipaddress.ip_address(ip).is_loopback and ip != "0.0.0.0"
    with socket.socket() as sock:  # the address belongs to this host: we can bind to it
        sock.bind((ip, 0))


def test_head_command_binds_the_node_ip_and_keeps_the_dashboard_local():
    args = parse_args(["head", "--num-cpus", "64", "--num-gpus", "8", "--port", "6380", "--temp-dir", "/tmp/r",
                       "--", "--object-store-memory=1000"])
    cmd = ray_start_command(args, "10.1.2.3")
    assert cmd[1:5] == ["-m", "ray.scripts.scripts", "start", "--block"]
    assert "--node-ip-address=10.1.2.3" in cmd and "--head" in cmd and "--port=6380" in cmd
    assert "--num-cpus=64" in cmd and "--num-gpus=8" in cmd and "--temp-dir=/tmp/r" in cmd
    assert "--include-dashboard=false" in cmd and cmd[-1] == "--object-store-memory=1000"
    assert not any("0.0.0.0" in part for part in cmd)
    dash = ray_start_command(parse_args(["head", "--num-cpus", "2", "--dashboard"]), "10.1.2.3")
    assert "--include-dashboard=true" in dash and "--dashboard-host=127.0.0.1" in dash


def test_worker_command_joins_the_head():
    cmd = ray_start_command(parse_args(["worker", "--address", "10.1.2.3:6379", "--num-cpus", "8"]), "10.1.2.4")
    assert "--address=10.1.2.3:6379" in cmd and "--node-ip-address=10.1.2.4" in cmd and "--head" not in cmd
    assert "--num-gpus=0" in cmd


def test_ip_subcommand(capsys):
    assert node_main(["ip", "--interface", "lo"]) == 0
    assert capsys.readouterr().out.strip() == "127.0.0.1"
    assert node_main(["ip", "--interface", "nosuch0"]) == 2
    assert "interface 'nosuch0'" in capsys.readouterr().err


def test_token_auth_is_required_unless_disabled(tmp_path):
    from megaflow.launch.auth import enable_token_auth, token_source

    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home)}
    with pytest.raises(ValueError, match="no Ray authentication token: create one readable only by you"):
        enable_token_auth(env, required=True)
    assert enable_token_auth(env) is False and "RAY_AUTH_MODE" not in env  # nothing to enable
    assert enable_token_auth({"HOME": str(home), "RAY_AUTH_MODE": "disabled"}, required=True) is False
    token = tmp_path / "token"
    token.write_text("ab" * 32)
    env = {"HOME": str(home), "RAY_AUTH_TOKEN_PATH": str(token)}
    assert enable_token_auth(env, required=True) and env["RAY_AUTH_MODE"] == "token"
    assert token_source(env) == str(token)
    with pytest.raises(ValueError, match="RAY_AUTH_TOKEN_PATH=.*missing does not exist"):
        enable_token_auth({"HOME": str(home), "RAY_AUTH_TOKEN_PATH": str(tmp_path / "missing")})
    (home / ".ray").mkdir()
    (home / ".ray" / "auth_token").write_text("cd" * 32)
    env = {"HOME": str(home)}
    assert enable_token_auth(env) and env["RAY_AUTH_MODE"] == "token"
    assert token_source({"RAY_AUTH_TOKEN": "x"}) == "$RAY_AUTH_TOKEN"


def test_node_start_refuses_without_a_token(tmp_path, monkeypatch, capsys):
    for key in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert node_main(["head", "--num-cpus", "1", "--interface", "lo"]) == 2
    assert "no Ray authentication token" in capsys.readouterr().err


def test_node_daemons_start_workers_at_normal_priority(tmp_path, monkeypatch):
    from megaflow.launch import node

    assert node.node_env({}) == {"RAY_worker_niceness": "0"}  # Ray's own default is 15
    assert node.node_env({"RAY_worker_niceness": "10"}) == {"RAY_worker_niceness": "10"}  # the user's is kept
    # main() changes the environment it execs with: give it a copy without the variable
    env = {k: v for k, v in os.environ.items() if k != "RAY_worker_niceness"}
    monkeypatch.setattr(os, "environ", {**env, "HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"})
    execs = []

    def fake_execv(path, argv):
        execs.append((argv, os.environ.get("RAY_worker_niceness")))
        raise SystemExit(0)

    monkeypatch.setattr(node.os, "execv", fake_execv)
    with pytest.raises(SystemExit):
        node_main(["head", "--num-cpus", "1", "--interface", "lo"])
    (argv, niceness), = execs
    assert argv[3:5] == ["start", "--block"] and niceness == "0"  # ray start inherits it through execv
