"""``RayWorkerGroup.submit``: any registered method started without waiting, and its futures."""
from __future__ import annotations

import contextlib

import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.single_controller import ClassWithInitArgs, DataProtoFuture, RayWorkerGroup, ResourcePool
from megaflow.single_controller.futures import GroupFuture
from single_controller_workers import MeshWorker, ScaleWorker

pytestmark = pytest.mark.slow


@contextlib.contextmanager
def _group(name: str, cls: type, *args, **kwargs):
    """A 2-rank group of ``cls`` with its world initialised; removed on exit."""
    pool = ResourcePool([2], num_cpus_per_process=0.5, name_prefix=f"sc_{name}")
    group = RayWorkerGroup(pool, ClassWithInitArgs(cls, *args, **kwargs), name_prefix=name)
    try:
        group.call("init")
        yield group
    finally:
        group.shutdown()
        pool.remove()


@pytest.fixture(scope="module")
def scale_group(sc_ray):
    with _group("submit", ScaleWorker, 3.0) as group:
        yield group


def test_submit_returns_futures_whose_values_equal_the_blocking_calls(scale_group):
    world = scale_group.submit("world")
    assert isinstance(world, GroupFuture)
    ranks = world.get()
    assert [(r, size, total) for r, size, _, total in ranks] == [(0, 2, 3.0), (1, 2, 3.0)]  # 1 + 2 all-reduced
    assert world.done()

    values = torch.arange(5, dtype=torch.float32)  # 5 rows on 2 ranks: padded and unpadded
    data = DataProto.from_dict({"row": torch.arange(5), "values": values})
    future = scale_group.submit("scale", data)
    assert isinstance(future, DataProtoFuture)
    out = future.get()
    assert torch.equal(out.batch["values"], values * 3.0)
    assert torch.equal(out.batch["row"], torch.arange(5))
    # A future passed on: the next call's workers resolve it (no round trip through the controller).
    twice = scale_group.call("scale", future)
    assert torch.equal(twice.batch["values"], values * 9.0)


def test_submit_refuses_an_unregistered_method(scale_group):
    with pytest.raises(AttributeError, match="no registered method 'nope'"):
        scale_group.submit("nope")


@pytest.fixture
def mesh_pair(sc_ray):
    with _group("pair", MeshWorker, tp=1) as group:
        yield group


def test_calls_waited_together_fail_at_the_first_failing_rank(scale_group, mesh_pair):
    import time

    from megaflow.single_controller import WorkerError

    first, second = GroupFuture.get_together([scale_group.submit("world"), mesh_pair.submit("calls")])
    assert [r[:2] for r in first] == [(0, 2), (1, 2)] and len(second) == 2
    # rank 0 of the pair then waits in an all-reduce that rank 1 never joins: the failure of
    # rank 1 surfaces at once, also though the other call of the two has long finished
    start = time.perf_counter()
    with pytest.raises(WorkerError, match=r"(?s)rank 1.*injected failure on rank 1"):
        GroupFuture.get_together([scale_group.submit("world"), mesh_pair.submit("fail_on", 1, True)])
    assert time.perf_counter() - start < 30
