"""The weight transports on a fake engine: the colocated one loads buckets in place; the
broadcast one carries them over a stateless gloo group (TCPStore + ProcessGroupGloo) from a
source process to two receivers, tensor for tensor, and an unchanged sync as an empty stream."""
from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from megaflow.hybrid_engine.transport import ColocatedTransport, load_buckets


class FakeEngine:
    """Records the streamed-update calls of :class:`~megaflow.rollout.VLLMRollout`."""

    def __init__(self, fail_on_bucket: int | None = None):
        self.calls, self.loaded, self.weight_version = [], {}, 0
        self.fail_on_bucket = fail_on_bucket

    def begin_weight_update(self):
        self.calls.append("begin")

    def load_weight_bucket(self, bucket):
        if self.fail_on_bucket is not None and len([c for c in self.calls if c == "load"]) == self.fail_on_bucket:
            raise ValueError("bad shard")
        self.calls.append("load")
        self.loaded.update({name: t.clone() for name, t in bucket})

    def abort_weight_update(self):
        self.calls.append("abort")

    def finish_weight_update(self):
        self.calls.append("finish")
        self.weight_version += 1
        return self.weight_version


def _buckets():
    gen = torch.Generator().manual_seed(0)
    return [[("a.weight", torch.randn(3, 4, generator=gen)), ("a.bias", torch.randn(3, generator=gen))],
            [("b.weight", torch.randn(5, 2, generator=gen).to(torch.bfloat16))]]


def test_colocated_transport_loads_every_bucket_and_aborts_on_failure():
    engine = FakeEngine()
    stats = ColocatedTransport(engine).send(iter(_buckets()), version=4)
    assert engine.calls == ["begin", "load", "load", "finish"] and engine.weight_version == 1
    assert stats.num_buckets == 2 and stats.bytes_sent == 4 * (12 + 3) + 2 * 10 and stats.version == 4
    for name, tensor in (pair for bucket in _buckets() for pair in bucket):
        assert torch.equal(engine.loaded[name], tensor)
    broken = FakeEngine(fail_on_bucket=1)
    with pytest.raises(ValueError, match="bad shard"):
        load_buckets(broken, iter(_buckets()))
    assert broken.calls == ["begin", "load", "abort"]


def _member(rank: int, port: int, queue) -> None:
    from megaflow.hybrid_engine.transport import BroadcastTransport, stateless_process_group

    store = torch.distributed.TCPStore("127.0.0.1", port, None, rank == 0, wait_for_workers=False)
    transport = BroadcastTransport(stateless_process_group(store, rank, 3, backend="gloo", prefix="t0",
                                                           timeout_s=60), "gloo")
    if rank == 0:
        sent = transport.send(iter(_buckets()), version=7)
        transport.send_unchanged(7)
        queue.put((rank, sent.bytes_sent, sent.num_buckets))
        return
    engine = FakeEngine()
    stats, changed = transport.receive(engine)
    again, changed_again = transport.receive(engine)
    queue.put((rank, stats.bytes_received, stats.version, changed, changed_again, again.num_buckets,
               engine.calls, {k: v.tolist() for k, v in engine.loaded.items()},
               {k: str(v.dtype) for k, v in engine.loaded.items()}))


def test_broadcast_transport_delivers_the_buckets_to_every_receiver():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, port, queue)) for r in range(3)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        item = queue.get(timeout=120)
        results[item[0]] = item
    for p in procs:
        p.join(timeout=60)
    payload = 4 * (12 + 3) + 2 * 10
    assert results[0][1:] == (payload, 2)
    expected = {name: t.tolist() for bucket in _buckets() for name, t in bucket}
    dtypes = {name: str(t.dtype) for bucket in _buckets() for name, t in bucket}
    for rank in (1, 2):
        _, received, version, changed, changed_again, empty_buckets, calls, loaded, loaded_dtypes = results[rank]
        assert (received, version, changed, changed_again, empty_buckets) == (payload, 7, True, False, 0)
        assert calls == ["begin", "load", "load", "finish"]  # the unchanged sync left the engine alone
        assert loaded == expected and loaded_dtypes == dtypes
