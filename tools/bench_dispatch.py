"""Benchmark: an ``nd_compute`` round trip through a (dp=2, tp=2) group vs plain ray.put/ray.get.

Moves a DataProto of ``--batch`` x ``--seq-len`` tokens (input_ids, attention_mask,
position_ids as int64; old_log_probs, advantages as float32) through a 4-rank group laid
out like Megatron (tp fastest: dp_rank = rank // 2, collect on tp rank 0) and back; every
rank's method returns a DataProto of the same size. The baseline moves the same bytes to
the same actors with plain Ray: one ``ray.put`` of a dict of arrays per dp chunk, the
same reference to both tp peers, one ``ray.get`` of the collect ranks' dicts, concatenate.
Two baselines: dicts of torch tensors (what a plain Ray program would send; Ray pickles
them in-band) and dicts of numpy arrays (Ray's zero-copy path, the transport floor).

Prints the median and best time of each and the ratios. Usage::

    python tools/bench_dispatch.py [--batch 256] [--seq-len 1024] [--reps 10]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import ray
import torch

from megaflow.protocol import DataProto
from megaflow.single_controller import (
    ClassWithInitArgs,
    Dispatch,
    RayWorkerGroup,
    ResourcePool,
    Worker,
    nd_compute,
    register,
)

TP = 2
DP = 2


class EchoWorker(Worker):
    """Returns what it receives (same size), through nd_compute or as a plain dict of tensors."""

    @register(Dispatch.ONE_TO_ALL)
    def init(self) -> None:
        torch.set_num_threads(1)
        self.register_dp_info("bench", dp_rank=self.rank // TP, is_collect=self.rank % TP == 0)

    @register(nd_compute("bench"))
    def echo(self, data: DataProto) -> DataProto:
        return DataProto(data.batch, dict(data.non_tensor_batch), dict(data.meta_info))

    def echo_tensors(self, tensors: dict[str, torch.Tensor], return_output: bool) -> dict[str, torch.Tensor] | None:
        return dict(tensors) if return_output else None


def make_tensors(batch: int, seq_len: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 50_000, (batch, seq_len), generator=g),
        "attention_mask": torch.ones(batch, seq_len, dtype=torch.long),
        "position_ids": torch.arange(seq_len).expand(batch, seq_len).contiguous(),
        "old_log_probs": -torch.rand(batch, seq_len, generator=g),
        "advantages": torch.randn(batch, seq_len, generator=g),
    }


def nd_round_trip(group: RayWorkerGroup, data: DataProto) -> DataProto:
    return group.call("echo", data)


def plain_round_trip(group: RayWorkerGroup, tensors: dict[str, torch.Tensor],
                     as_numpy: bool) -> dict[str, torch.Tensor]:
    size = next(iter(tensors.values())).shape[0] // DP
    arrays = {k: v.numpy() for k, v in tensors.items()} if as_numpy else tensors
    refs = [ray.put({k: v[d * size:(d + 1) * size] for k, v in arrays.items()}) for d in range(DP)]
    outs = [group.execute_async(r, "echo_tensors", refs[r // TP], r % TP == 0) for r in range(DP * TP)]
    chunks = ray.get([outs[d * TP] for d in range(DP)])
    ray.wait(outs, num_returns=len(outs))
    if as_numpy:
        return {k: torch.from_numpy(np.concatenate([c[k] for c in chunks])) for k in tensors}
    return {k: torch.cat([c[k] for c in chunks]) for k in tensors}


def timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()

    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    pool = ResourcePool([DP * TP], num_cpus_per_process=1.0, name_prefix="bench")
    group = RayWorkerGroup(pool, ClassWithInitArgs(EchoWorker), name_prefix="bench")
    group.call("init")
    tensors = make_tensors(args.batch, args.seq_len)
    data = DataProto.from_dict(tensors)
    num_bytes = sum(v.numel() * v.element_size() for v in tensors.values())

    out = nd_round_trip(group, data)  # warm-up and correctness check
    assert all(torch.equal(out.tensors[k], v) for k, v in tensors.items()), "nd_compute changed the data"
    for as_numpy in (False, True):
        plain = plain_round_trip(group, tensors, as_numpy)
        assert all(torch.equal(plain[k], v) for k, v in tensors.items()), "plain round trip changed the data"

    runs = {"nd_compute": lambda: nd_round_trip(group, data),
            "plain, torch tensors": lambda: plain_round_trip(group, tensors, False),
            "plain, numpy arrays": lambda: plain_round_trip(group, tensors, True)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):  # interleaved, so that all see the same machine load
        for name, fn in runs.items():
            times[name] += timed(fn, 1)
    group.shutdown()
    pool.remove()
    ray.shutdown()

    fields = ", ".join(f"{k}({str(v.dtype).removeprefix('torch.')})" for k, v in tensors.items())
    print(f"payload: {args.batch} x {args.seq_len} tokens: {fields} = {num_bytes / 2**20:.1f} MiB each way")
    print(f"(dp={DP}, tp={TP}) group of Ray actors, {args.reps} reps")
    for name, ts in times.items():
        print(f"  {name:<22} median {statistics.median(ts) * 1e3:7.1f} ms   best {min(ts) * 1e3:7.1f} ms")
    nd = statistics.median(times["nd_compute"])
    for name in ("plain, torch tensors", "plain, numpy arrays"):
        print(f"ratio nd_compute / {name} (median): {nd / statistics.median(times[name]):.2f}")


if __name__ == "__main__":
    main()
