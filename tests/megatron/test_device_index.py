"""The device index under Ray: one visible GPU per rank, ``LOCAL_RANK`` = the node index 3.

CUDA is mocked as one device (what Ray's ``CUDA_VISIBLE_DEVICES`` leaves a rank): any
ordinal but 0 fails like CUDA's "invalid device ordinal". Megatron's ``set_device``, vLLM's
external-launcher environment and vLLM's group construction must all land on device 0;
before megaflow.utils.device they used 3.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from megaflow.utils.device import NODE_LOCAL_RANK_ENV, device_local_rank, rank_device_env


class OneVisibleGpu:
    """``torch.cuda`` of a process that sees exactly one GPU."""

    def __init__(self) -> None:
        self.current = 0

    def check(self, index: int) -> None:
        if not 0 <= int(index) < 1:
            raise RuntimeError(f"CUDA error: invalid device ordinal {index} (1 device visible)")

    def set_device(self, index: int) -> None:
        self.check(index)
        self.current = int(index)


@pytest.fixture
def one_gpu(monkeypatch):
    gpu = OneVisibleGpu()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", gpu.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: gpu.current)
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.delenv(NODE_LOCAL_RANK_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    return gpu


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_device_local_rank_by_visible_devices():
    assert device_local_rank(3, 1) == 0  # Ray: one GPU per rank
    assert device_local_rank(3, 8) == 3  # torchrun: every GPU of the node visible
    assert device_local_rank(3, 0) == 3  # CPU: nothing to index, the node index stays
    with pytest.raises(RuntimeError, match="node-local index 3 sees 2 CUDA devices"):
        device_local_rank(3, 2)


def test_the_host_environment_keeps_the_node_index_apart(one_gpu):
    assert rank_device_env(3) == {"LOCAL_RANK": "0", NODE_LOCAL_RANK_ENV: "3"}


def test_megatron_binds_the_visible_gpu(one_gpu):
    from megaflow.megatron import parallel

    parallel._set_cuda_device()  # before: torch.cuda.set_device(3) -> invalid device ordinal
    assert one_gpu.current == 0
    assert (os.environ["LOCAL_RANK"], os.environ[NODE_LOCAL_RANK_ENV]) == ("0", "3")


def test_vllm_external_launcher_reads_the_visible_gpu(one_gpu, world_of_one):
    from megaflow.rollout.vllm_rollout import _prepare_process_env

    assert _prepare_process_env() == "external_launcher"
    # vllm/v1/executor/uniproc_executor.py reads $LOCAL_RANK as the device; gpu_worker.py asserts
    # local_rank < torch.cuda.device_count() (before: setdefault kept 3)
    one_gpu.check(int(os.environ["LOCAL_RANK"]))
    assert os.environ[NODE_LOCAL_RANK_ENV] == "3"


def test_vllm_groups_are_built_on_the_visible_gpu(one_gpu, world_of_one, monkeypatch):
    from vllm.distributed import parallel_state as ps

    from megaflow.rollout import vllm_groups

    seen = []

    def init_group(groups, local_rank, backend, **kwargs):  # vLLM's GroupCoordinator: cuda:{local_rank}
        one_gpu.check(local_rank)
        seen.append(local_rank)
        return object()

    def init_world(world_size, rank, method, local_rank, backend):
        one_gpu.check(local_rank)
        seen.append(local_rank)

    for name in ("_TP", "_ETP", "_DCP", "_PCP", "_PP", "_DP"):
        monkeypatch.setattr(ps, name, getattr(ps, name, None), raising=False)
    monkeypatch.setattr(ps, "init_distributed_environment", init_world)
    monkeypatch.setattr(ps, "init_model_parallel_group", init_group)
    monkeypatch.setattr(ps, "get_world_group", lambda: type("G", (), {"device_group": dist.group.WORLD})())
    vllm_groups._init_vllm_groups([[0]], 1, 0)  # before: LOCAL_RANK=3 -> cuda:3
    assert seen == [0] * 6
