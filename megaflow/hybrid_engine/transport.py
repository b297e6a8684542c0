"""How the actor's generation shards reach the rollout engines: the weight transport.

The 3D-HybridEngine turns every actor rank's training shard into its generation shard
(TP = t_g, :class:`~megaflow.hybrid_engine.reshard.MicroDPResharder`); the shard is then
converted to vLLM's names and layouts and cut into buckets of at most
``rollout.weight_sync_bucket_mb`` (:func:`~megaflow.hybrid_engine.rollout_weights.iter_vllm_buckets`). A
:class:`WeightTransport` moves those
buckets into an engine:

* :class:`ColocatedTransport` - the engine lives in the caller's process: buckets go
  straight into it (:func:`load_buckets`). The colocated actor
  (:meth:`megaflow.workers.actor_rollout.ActorRolloutWorker.sync_rollout_weights`) does
  not go through this class: its own sync loop calls :func:`load_buckets` directly; only
  the tests use this class.
* :class:`BroadcastTransport` - split placement: the engines live on their own resource
  pool with their own ``torch.distributed`` world. For every generation TP rank ``j`` one
  actor rank holding shard ``j`` (the ranks of generation replica 0) broadcasts each
  bucket to every rollout rank of TP rank ``j`` over a process group of its own (gloo on
  CPU, NCCL on GPU), created outside both worlds from a ``torch.distributed.TCPStore``
  and a ``ProcessGroupGloo``/``ProcessGroupNCCL`` built directly on it (the "stateless
  process group" of vLLM's ``stateless_init_torch_distributed_process_group`` and
  OpenRLHF/verl's ``init_custom_process_group``).

Wire format of :class:`BroadcastTransport` (per bucket, three broadcasts from the
source): the byte length of a JSON header (int64 ``[1]``), the header (uint8: names,
shapes, dtypes, the actor's weight version, an end flag) and the bucket's tensors as one
flat uint8 buffer. A stream ends with a header whose ``end`` is true; a sync with
unchanged weights is that header alone (the engine is then left as it is).

Sync volume: every rollout rank receives its whole generation shard once per sync,
``M / t_g`` bytes for a model of ``M`` bytes (:func:`split_sync_bytes`).
"""
from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from megaflow.topology.split_layout import TransportGroup, TransportPlan, plan_split_transport, split_sync_bytes

_STORE_PREFIX = "megaflow_weight_transport"


# ---------------------------------------------------------------------------- engine side
def load_buckets(engine: Any, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> tuple[int, int, int]:
    """One streamed weight update of a :class:`~megaflow.rollout.VLLMRollout`.

    Opens the update, loads every bucket (dropping each before the next is produced) and
    closes it; a failure aborts the update (the engine then refuses to generate).

    Returns:
        ``(buckets loaded, bytes loaded, bytes of the largest bucket)``.
    """
    count = nbytes = largest = 0
    engine.begin_weight_update()
    try:
        for bucket in buckets:
            engine.load_weight_bucket(bucket)
            count += 1
            size = sum(t.numel() * t.element_size() for _, t in bucket)
            nbytes, largest = nbytes + size, max(largest, size)
            del bucket
    except BaseException:
        engine.abort_weight_update()
        raise
    engine.finish_weight_update()
    return count, nbytes, largest


# ---------------------------------------------------------------------------- transports
@dataclass
class TransportStats:
    """What one sync moved through a transport (this rank's view).

    Attributes:
        bytes_sent / bytes_received: tensor payload bytes (headers excluded).
        num_buckets: buckets moved.
        seconds: wall time of the transfer and the engine's loading.
        version: the actor's weight version the stream carried.
        largest_bucket: bytes of the largest bucket moved.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    num_buckets: int = 0
    seconds: float = 0.0
    version: int = -1
    largest_bucket: int = 0

    def as_metrics(self) -> dict[str, float]:
        """``transport/bytes_sent``, ``transport/bytes_received``, ``transport/num_buckets``
        and ``timing_s/transport`` (seconds)."""
        return {"transport/bytes_sent": float(self.bytes_sent), "transport/bytes_received": float(self.bytes_received),
                "transport/num_buckets": float(self.num_buckets), "timing_s/transport": self.seconds}


class WeightTransport:
    """Moves generation buckets from the actor into rollout engines (one sync per call).

    :meth:`send` runs on actor ranks, :meth:`receive` on ranks holding an engine; for a
    given sync every member of a transport calls its side once, in lockstep.
    """

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: int) -> TransportStats:
        """Deliver ``buckets`` (the actor's weights at ``version``) to the engine(s)."""
        raise NotImplementedError

    def send_unchanged(self, version: int) -> TransportStats:
        """Tell the engine(s) that the weights did not change since the last sync."""
        return TransportStats(version=version)


class ColocatedTransport(WeightTransport):
    """The engine shard lives in this (actor) process: buckets are loaded in place.

    Args:
        engine: this rank's :class:`~megaflow.rollout.VLLMRollout`.
    """

    def __init__(self, engine) -> None:
        self.engine = engine

    def send(self, buckets, version):
        start = time.perf_counter()
        stats = TransportStats(version=version)
        stats.num_buckets, stats.bytes_sent, stats.largest_bucket = load_buckets(self.engine, buckets)
        stats.seconds = time.perf_counter() - start
        return stats


def _device_for(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def stateless_process_group(store, rank: int, size: int, *, backend: str, prefix: str,
                            timeout_s: float = 1800.0):
    """A process group over ``size`` processes outside any ``torch.distributed`` world.

    Args:
        store: a ``torch.distributed.TCPStore`` every member reaches.
        rank, size: this process's rank in the group and the group's size.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).
        prefix: key prefix that keeps this group apart from others on the same store.
        timeout_s: collective timeout.

    Returns:
        The ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` (blocks until every member joined).

    Raises:
        ValueError: another backend.
    """
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{_STORE_PREFIX}/{prefix}", store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, size, options)
    raise ValueError(f"weight transport backend must be 'gloo' or 'nccl', got {backend!r}")


class BroadcastTransport(WeightTransport):
    """Broadcast of buckets from one actor rank (group rank 0) to rollout ranks.

    Args:
        group: the stateless process group (:func:`stateless_process_group`): rank 0 is
            the source actor rank, ranks 1.. the rollout ranks of one generation TP rank.
        backend: ``"gloo"`` or ``"nccl"`` (where buffers live).
    """

    def __init__(self, group, backend: str) -> None:
        self.group, self.backend = group, backend
        self.device = _device_for(backend)

    def _broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        on_device = tensor.to(self.device)
        self.group.broadcast([on_device], opts).wait()
        return on_device

    def _send_header(self, header: dict) -> None:
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)
        self._broadcast(torch.tensor([raw.numel()], dtype=torch.int64))
        self._broadcast(raw)

    def _receive_header(self) -> dict:
        length = self._broadcast(torch.zeros(1, dtype=torch.int64))
        raw = self._broadcast(torch.zeros(int(length.item()), dtype=torch.uint8)).cpu()
        return json.loads(bytes(raw.numpy()).decode())

    def send(self, buckets, version):
        start = time.perf_counter()
        stats = TransportStats(version=version)
        for bucket in buckets:
            names = [n for n, _ in bucket]
            tensors = [t.detach().contiguous() for _, t in bucket]
            self._send_header({"end": False, "version": version, "names": names,
                               "shapes": [list(t.shape) for t in tensors],
                               "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors]})
            flat = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])
            self._broadcast(flat)
            stats.bytes_sent += flat.numel()
            stats.num_buckets += 1
            stats.largest_bucket = max(stats.largest_bucket, flat.numel())
        self._send_header({"end": True, "version": version, "changed": True})
        stats.seconds = time.perf_counter() - start
        return stats

    def send_unchanged(self, version):
        self._send_header({"end": True, "version": version, "changed": False})
        return TransportStats(version=version)

    def receive(self, engine) -> tuple[TransportStats, bool]:
        """Receive one sync stream and load it into ``engine`` bucket by bucket.

        Returns:
            ``(stats, changed)``: ``changed`` is False when the actor's weights had not
            moved (the engine was not touched).
        """
        start = time.perf_counter()
        stats = TransportStats()
        header = self._receive_header()
        stats.version = int(header["version"])
        if header["end"]:
            return stats, False

        def buckets() -> Iterator[list[tuple[str, torch.Tensor]]]:
            nonlocal header
            while not header["end"]:
                sizes = [_numel(s) * torch.empty((), dtype=getattr(torch, d)).element_size()
                         for s, d in zip(header["shapes"], header["dtypes"], strict=True)]
                flat = self._broadcast(torch.empty(sum(sizes), dtype=torch.uint8))
                bucket, offset = [], 0
                fields = zip(header["names"], header["shapes"], header["dtypes"], sizes, strict=True)
                for name, shape, dtype, size in fields:
                    bucket.append((name, flat[offset:offset + size].view(getattr(torch, dtype)).reshape(shape)))
                    offset += size
                stats.bytes_received += flat.numel()
                yield bucket
                header = self._receive_header()

        stats.num_buckets = load_buckets(engine, buckets())[0]
        stats.seconds = time.perf_counter() - start
        return stats, True


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


__all__ = ["WeightTransport", "ColocatedTransport", "BroadcastTransport", "TransportStats", "TransportPlan",
           "TransportGroup", "plan_split_transport", "stateless_process_group", "load_buckets", "split_sync_bytes"]
