"""ResourcePool and Worker without processes: validation, rank layout, dp-info registration."""
from __future__ import annotations

import pytest

from megaflow.single_controller import Dispatch, DPInfo, ResourcePool, Worker, registered_methods


@pytest.mark.parametrize("kwargs,error,match", [
    ({"process_on_nodes": []}, ValueError, "non-empty list"),
    ({"process_on_nodes": [2, 0]}, ValueError, "ints >= 1"),
    ({"process_on_nodes": 4}, TypeError, "list of ranks per node"),
    ({"process_on_nodes": [2], "max_colocate_count": 0}, ValueError, "max_colocate_count"),
    ({"process_on_nodes": [2], "num_cpus_per_process": 0}, ValueError, "num_cpus_per_process"),
    ({"process_on_nodes": [2], "name_prefix": ""}, ValueError, "name_prefix"),
])
def test_resource_pool_rejects_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        ResourcePool(**kwargs)


def test_resource_pool_rank_order_and_shares():
    pool = ResourcePool([2, 3], max_colocate_count=2, use_gpu=True, num_cpus_per_process=0.5)
    assert pool.world_size == 5 and pool.num_nodes == 2
    assert pool.rank_layout() == [(0, 0), (0, 1), (1, 0), (1, 1), (1, 2)]
    assert pool.bundle() == {"CPU": 0.5, "GPU": 1.0}
    assert pool.actor_resources() == {"num_cpus": 0.25, "num_gpus": 0.5}
    assert pool.actor_threads() == 1  # a quarter CPU still runs one thread
    assert ResourcePool([1], max_colocate_count=2, num_cpus_per_process=4).actor_threads() == 2
    assert ResourcePool([1], num_cpus_per_process=3.5).actor_threads() == 3
    pool.attach_group()
    pool.attach_group()
    with pytest.raises(RuntimeError, match="already hosts 2 worker group"):
        pool.attach_group()
    pool.detach_group()
    pool.attach_group()


def test_resource_pool_needs_ray_for_placement_groups(monkeypatch):
    import ray

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match="ray.init"):
        ResourcePool([1]).placement_groups()


@pytest.fixture
def rank_env(monkeypatch):
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.7")
    monkeypatch.setenv("MASTER_PORT", "29500")


def test_worker_reads_its_place_from_the_environment(rank_env):
    w = Worker()
    assert (w.rank, w.world_size, w.local_rank, w.master_addr, w.master_port) == (3, 4, 1, "10.0.0.7", 29500)


def test_worker_without_group_environment_explains(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="RANK is not set"):
        _ = Worker().rank


def test_dp_info_registration(rank_env):
    class NoSuperInit(Worker):
        def __init__(self):  # forgetting super().__init__() must not break registration
            pass

    for w in (Worker(), NoSuperInit()):
        w.register_dp_info("actor", dp_rank=1, is_collect=False)
        w.register_dp_info("actor", dp_rank=1, is_collect=False)  # same again: fine
        assert w.get_dp_info("actor") == DPInfo(1, False)
        with pytest.raises(ValueError, match="cannot change"):
            w.register_dp_info("actor", dp_rank=0, is_collect=False)
        with pytest.raises(KeyError, match="'rollout' is not registered.*registered: \\['actor'\\]"):
            w.get_dp_info("rollout")
    with pytest.raises(ValueError, match="dp_rank"):
        Worker().register_dp_info("actor", dp_rank=-1, is_collect=True)
    with pytest.raises(ValueError, match="is_collect"):
        Worker().register_dp_info("actor", dp_rank=0, is_collect=1)
    assert registered_methods(Worker)["get_dp_info"].dispatch_mode is Dispatch.ONE_TO_ALL
