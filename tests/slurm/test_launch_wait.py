"""Bounded waits for a Ray cluster: the session's local Ray and scripted node lists."""
import math
import socket
import time

import pytest

from megaflow.launch.cluster import ClusterNotReadyError, wait_for_cluster, wait_for_port
from megaflow.launch.resources import NodeResources, launch_requirements
from megaflow.launch.wait import main as wait_main
from megaflow.topology import load_run


def tiny(*overrides):
    return launch_requirements(load_run("tiny_arith_grpo", list(overrides)))


def local_cpus(ray):
    return int(ray.cluster_resources()["CPU"])


def test_met_requirement_returns_at_once(ray_session):
    lines = []
    start = time.monotonic()
    nodes = wait_for_cluster(tiny(), timeout_s=30, poll_s=0.2, progress=lines.append)
    assert time.monotonic() - start < 5
    assert sum(n.alive for n in nodes) == len(ray_session.nodes()) == 1
    assert lines[0].startswith("waiting up to 30 s for 1 node, each with 2 CPUs")
    assert lines[-1].startswith("cluster ready after")


def test_too_few_nodes_fails_within_the_bound_with_what_is_needed_and_joined(ray_session):
    cpus = local_cpus(ray_session)
    start = time.monotonic()
    with pytest.raises(ClusterNotReadyError) as info:
        wait_for_cluster(tiny("resources.nodes=2"), timeout_s=1.5, poll_s=0.2, address="10.9.9.9:6379",
                         hint="see logs/ray-worker-*.log", progress=None)
    elapsed = time.monotonic() - start
    assert 1.5 <= elapsed < 10
    msg = str(info.value)
    assert "the Ray cluster at 10.9.9.9:6379 does not offer what run 'tiny_arith_grpo' needs" in msg
    assert "needed: 2 nodes, each with 2 CPUs (4 CPUs in all)" in msg
    assert "pool 'global' (actor): 2 nodes x 2 ranks, each rank 1 CPU" in msg
    assert f"joined: 1 node ({cpus} CPUs in all)" in msg
    assert "missing: 1 more node with 2 CPUs" in msg
    assert msg.rstrip().endswith("hint: see logs/ray-worker-*.log")


def test_too_few_cpus_on_the_node_fails_naming_cpus(ray_session):
    cpus = local_cpus(ray_session)
    per_proc = cpus  # 2 ranks x cpus each: twice what the node has
    with pytest.raises(ClusterNotReadyError) as info:
        wait_for_cluster(tiny(f"resources.num_cpus_per_proc={per_proc}"), timeout_s=0.5, poll_s=0.1, progress=None)
    msg = str(info.value)
    assert f"needed: 1 node, each with {2 * per_proc} CPUs" in msg
    assert f"missing: 1 more node with {2 * per_proc} CPUs; enough nodes joined" in msg


def test_nodes_joining_late_are_waited_for():
    required = tiny("resources.nodes=2")
    joined = [NodeResources("a", "10.0.0.1", "n1", 2, 0, True)]
    polls = []

    def nodes_fn():
        polls.append(time.monotonic())
        if len(polls) == 3:
            joined.append(NodeResources("b", "10.0.0.2", "n2", 4, 0, True))
        return list(joined)

    nodes = wait_for_cluster(required, timeout_s=20, poll_s=0.05, progress=None, nodes_fn=nodes_fn)
    assert len(polls) == 3 and [n.ip for n in nodes] == ["10.0.0.1", "10.0.0.2"]


@pytest.mark.parametrize("bad", [0, -1, math.inf, math.nan, True, "10"])
def test_timeout_must_be_finite_and_positive(bad):
    with pytest.raises(ValueError, match="timeout_s must be a finite number of seconds > 0"):
        wait_for_cluster(tiny(), timeout_s=bad, nodes_fn=list)


def test_wait_for_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        wait_for_port("127.0.0.1", server.getsockname()[1], timeout_s=5)
        port = server.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(ClusterNotReadyError, match=f"the Ray head at 127.0.0.1:{port} did not accept connections"):
        wait_for_port("127.0.0.1", port, timeout_s=0.6, poll_s=0.1)
    assert time.monotonic() - start < 5
    with pytest.raises(ValueError, match="port must be"):
        wait_for_port("127.0.0.1", 70000, timeout_s=1)


def test_wait_command_rejects_bad_recipe_and_missing_address(capsys, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert wait_main(["--recipe", "no_such_recipe"]) == 2
    assert "unknown recipe 'no_such_recipe'" in capsys.readouterr().err
    assert wait_main(["--recipe", "tiny_arith_grpo", "trainer.total_steps=1"]) == 2
    assert "no Ray cluster address" in capsys.readouterr().err
