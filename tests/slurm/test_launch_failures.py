"""Dead worker processes and nodes, explained by node, role and rank."""
import os
import signal
import time

import pytest
from ray.exceptions import ActorDiedError, NodeDiedError

from megaflow.launch.failures import (
    RESUME_HINT, RankProcess, WorkerLostError, is_worker_death, placements_of, worker_lost_error)
from megaflow.launch.resources import NodeResources
from megaflow.single_controller import ClassWithInitArgs, RayWorkerGroup, ResourcePool
from megaflow.single_controller.errors import WorkerError
from slurm_test_workers import PidWorker


def placements_on(ip, node_id, roles, ranks, pid0=1000, per_node=8, hostname=""):
    """Ranks ``ranks`` of each role, ``per_node`` per node, colocated roles sharing one pid per rank."""
    return [RankProcess(role=role, rank=r, node_id=f"{node_id}{r // per_node}", node_ip=f"{ip}{r // per_node}",
                          hostname=hostname and f"{hostname}{r // per_node}", pid=pid0 + r)
            for role in roles for r in ranks]


def test_killed_rank_of_a_real_group_names_role_rank_and_node(launch_ray):
    pool = ResourcePool([1], num_cpus_per_process=0.5, name_prefix="launch_fail")
    group = RayWorkerGroup(pool, ClassWithInitArgs(PidWorker), name_prefix="actor")
    try:
        (meta,) = group.worker_metadata
        assert group.call("pid") == [meta.pid]
        os.kill(meta.pid, signal.SIGKILL)  # the rank's Ray actor process, started by this test
        with pytest.raises(WorkerError) as info:
            for _ in range(50):  # the death reaches the owner asynchronously
                group.call("pid")
                time.sleep(0.2)
        assert is_worker_death(info.value)
        err = worker_lost_error(info.value, placements_of({"actor": group}))
    finally:
        group.shutdown()
        pool.remove()
    assert isinstance(err, WorkerLostError) and (err.role, err.rank) == ("actor", 0)
    lines = str(err).splitlines()
    assert lines[0] == (f"worker lost: role 'actor' rank 0 (node {meta.node_ip} ({meta.hostname}), "
                        f"pid {meta.pid}) died during actor.pid")
    assert lines[1].startswith(f"its node {meta.node_ip} is alive: the process was killed or crashed")
    assert lines[-1] == RESUME_HINT and err.lost == {"actor": [0]} and err.dead_nodes == ()


def test_raw_actor_died_error_is_matched_by_ip_and_pid(launch_ray):
    ray = launch_ray

    @ray.remote(num_cpus=0)
    class Probe:
        def where(self):
            return os.getpid(), ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    probe = Probe.remote()
    pid, node_id, ip = ray.get(probe.where.remote())
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ActorDiedError) as info:
        for _ in range(50):
            ray.get(probe.where.remote())
            time.sleep(0.2)
    placements = [RankProcess("critic", 3, node_id, ip, "", pid), RankProcess("ref", 3, node_id, ip, "", pid),
                  RankProcess("critic", 2, node_id, ip, "", pid - 1)]
    err = worker_lost_error(info.value, placements, method="update_critic")
    assert str(err).startswith(f"worker lost: role 'critic' rank 3 (node {ip}, pid {pid}) died during update_critic")
    # The process hosted the colocated reference role too; rank 2 (another process) is not lost.
    assert err.lost == {"critic": [3], "ref": [3]}


def test_dead_node_lists_every_role_and_rank_it_hosted():
    placements = placements_on("10.0.0.", "node", ("actor", "critic", "ref"), range(16), hostname="gpu-")
    nodes = [NodeResources("node0", "10.0.0.0", "gpu-0", 64, 8, True),
             NodeResources("node1", "10.0.0.1", "gpu-1", 64, 8, False)]
    error = WorkerError("role 'critic' (CriticWorker) rank 9 (node 10.0.0.1, pid 1009)", "critic.compute_values",
                        "the worker process died or was killed:\nThe actor died because its node has died.")
    err = worker_lost_error(error, placements, nodes=nodes)
    assert str(err).splitlines()[:2] == [
        "worker lost: role 'critic' rank 9 (node 10.0.0.1 (gpu-1), pid 1009) died during critic.compute_values",
        "node 10.0.0.1 (gpu-1) is dead; it ran actor ranks 8-15; critic ranks 8-15; ref ranks 8-15"]
    assert err.dead_nodes == ("10.0.0.1",)
    assert err.lost == {r: list(range(8, 16)) for r in ("actor", "critic", "ref")}


def test_node_died_error_without_a_rank():
    placements = placements_on("10.0.0.", "node", ("actor",), range(4), per_node=2)
    nodes = [NodeResources("node0", "10.0.0.0", "", 4, 0, False), NodeResources("node1", "10.0.0.1", "", 4, 0, True)]
    error = NodeDiedError("node 10.0.0.0 is dead or unreachable")
    assert is_worker_death(error)
    err = worker_lost_error(error, placements, nodes=nodes)
    assert str(err).splitlines()[:2] == ["worker lost: a worker process of the run died (NodeDiedError)",
                                         "node 10.0.0.0 is dead; it ran actor ranks 0-1"]
    assert (err.role, err.rank, err.lost) == (None, None, {"actor": [0, 1]})


def test_python_exceptions_in_workers_are_not_deaths():
    error = WorkerError("role 'actor' (A) rank 0 (node 1.2.3.4, pid 7)", "actor.update_actor",
                        "Traceback (most recent call last):\nValueError: bad batch")
    assert not is_worker_death(error)
    assert is_worker_death(WorkerError("w", "m", "the worker process died or was killed:\nboom"))
