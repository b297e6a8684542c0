"""Small worker classes for the single-controller tests (pickled by value into Ray actors)."""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

from megaflow.protocol import DataProto
from megaflow.single_controller import Dispatch, Execute, Worker, nd_compute, register


class MeshWorker(Worker):
    """A (dp, tp) mesh in Megatron rank order (tp fastest): dp_rank = rank // tp, collect on tp rank 0."""

    def __init__(self, tp: int, scale: float = 1.0) -> None:
        super().__init__()
        self.tp, self.scale = tp, scale
        self.num_calls = 0
        self.seen: list[int] = []

    @register(Dispatch.ONE_TO_ALL)
    def init(self) -> None:
        torch.set_num_threads(1)
        self.init_distributed(timeout_s=120.0)
        self.register_dp_info("mesh", dp_rank=self.rank // self.tp, is_collect=self.rank % self.tp == 0)

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_rank(self) -> float:
        """Sum of (rank + 1) over the world, via a gloo all-reduce."""
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        return float(t.item())

    @register(nd_compute("mesh"))
    def transform(self, data: DataProto) -> DataProto:
        """Record the rows seen; return ``values = input_ids * scale + dp_rank / 100``."""
        self.num_calls += 1
        if data.meta_info.get("fail_rank") == self.rank:
            raise RuntimeError(f"transform refused on rank {self.rank}")
        self.seen = data.batch["row"].tolist()
        dp_rank = self.rank // self.tp
        values = data.batch["input_ids"].float() * self.scale + dp_rank / 100.0
        return DataProto.from_dict({"row": data.batch["row"], "values": values}, meta_info={"dp_rank": dp_rank})

    @register(nd_compute("mesh"), blocking=False)
    def transform_async(self, data: DataProto) -> DataProto:
        return self.transform(data)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def add_rank(self, data: DataProto) -> DataProto:
        """Every rank is a dp slot: ``values + 1000 * (rank + 1)``; records the rows seen."""
        self.seen = data.batch["row"].tolist()
        values = data.batch["values"] + 1000.0 * (self.rank + 1)
        return DataProto.from_dict({"row": data.batch["row"], "values": values})

    @register(Dispatch.DP_COMPUTE_PROTO)
    def per_rank_metrics(self, data: DataProto) -> dict:
        self.num_calls += 1
        return {"rank": self.rank, "rows": data.batch["row"].tolist()}

    @register(Dispatch.ONE_TO_ALL)
    def last_seen(self) -> list[int]:
        return self.seen

    @register(Dispatch.ONE_TO_ALL)
    def calls(self) -> int:
        return self.num_calls

    @register(Dispatch.RANK_ZERO)
    def rank_zero_pid(self) -> tuple[int, int]:
        return self.rank, os.getpid()

    @register(Dispatch.ONE_TO_ALL, execute_mode=Execute.RANK_ZERO)
    def executed_on(self) -> int:
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def fail_on(self, rank: int, in_collective: bool) -> int:
        """Rank ``rank`` raises; with ``in_collective`` the others wait in an all-reduce meanwhile."""
        if self.rank == rank:
            raise ValueError(f"injected failure on rank {rank}")
        if in_collective:
            dist.all_reduce(torch.ones(1))
        return self.rank

    def exit_process(self) -> None:
        """Not registered; called on one rank with ``execute_async`` to simulate a crash."""
        os._exit(1)


class ScaleWorker(Worker):
    """A plain data-parallel role: ``values * factor`` per row (DP_COMPUTE_PROTO)."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    @register(Dispatch.ONE_TO_ALL)
    def init(self) -> None:
        torch.set_num_threads(1)
        self.init_distributed(timeout_s=120.0)

    @register(Dispatch.DP_COMPUTE_PROTO)
    def scale(self, data: DataProto) -> DataProto:
        return DataProto.from_dict({"row": data.batch["row"], "values": data.batch["values"] * self.factor})

    @register(Dispatch.DP_COMPUTE_PROTO, blocking=False)
    def scale_async(self, data: DataProto) -> DataProto:
        return self.scale(data)

    @register(Dispatch.ONE_TO_ALL)
    def world(self) -> tuple[int, int, int, float]:
        """(rank, world size, pid, all-reduced sum of rank + 1) as this role sees the process."""
        t = torch.tensor([self.rank + 1.0])
        dist.all_reduce(t)
        return self.rank, dist.get_world_size(), os.getpid(), float(t.item())


class BrokenWorker(Worker):
    """Its constructor fails on rank 1 (a bad config, say)."""

    def __init__(self) -> None:
        super().__init__()
        if self.rank == 1:
            raise ValueError("bad config on rank 1")


class CloseWorker(Worker):
    """Its ``close`` appends a line to ``<marker>.<rank>``, or, with ``fail``, raises."""

    def __init__(self, marker: str, fail: bool = False) -> None:
        super().__init__()
        self.marker, self.fail = marker, fail

    def close(self) -> None:
        if self.fail:
            raise OSError(f"cannot release on rank {self.rank}")
        with open(f"{self.marker}.{self.rank}", "a") as f:
            f.write(f"closed by pid {os.getpid()}\n")


class ThreadsWorker(Worker):
    """Reports the intra-op threads its process runs with."""

    @register(Dispatch.ONE_TO_ALL)
    def threads(self) -> tuple[int, str]:
        """(``torch.get_num_threads()``, ``$OMP_NUM_THREADS``) of this rank's process."""
        return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS", "")


class GcWorker(Worker):
    """Reports its process's garbage-collection state (megaflow.utils.startup_gc)."""

    def __init__(self) -> None:
        super().__init__()
        self.enabled_in_init_model = None

    @register(Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        self.enabled_in_init_model = gc.isenabled()

    @register(Dispatch.ONE_TO_ALL)
    def gc_state(self) -> tuple:
        """(enabled during init_model or None, enabled now, objects frozen now)."""
        return self.enabled_in_init_model, gc.isenabled(), gc.get_freeze_count()
