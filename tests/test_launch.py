"""run_distributed: spawned gloo worlds return per-rank results and surface rank errors."""
import pytest
import torch
import torch.distributed as dist

from megaflow.utils.launch import DistributedRunError, run_distributed


def _all_reduce(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on purpose")
    return rank


@pytest.mark.slow
def test_all_reduce_sum_and_rank_error():
    assert run_distributed(_all_reduce, 2) == [3.0, 3.0]
    with pytest.raises(DistributedRunError, match="rank 1 raised:(.|\n)*boom on purpose"):
        run_distributed(_fail_on_rank_one, 2, timeout_s=60)
