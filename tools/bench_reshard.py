#!/usr/bin/env python
"""Benchmark the weight sync (reshard + convert + push) against the naive gather-everything baseline.

    python tools/bench_reshard.py                     # 4 CPU ranks, t=2 p=2 -> t_g=2 and -> t_g=1
    python tools/bench_reshard.py --gen-tp 1 --hidden 512 --repeats 5 --bucket-mb 4

On 4 gloo ranks (training t=2, p=2, d=1; generation t_g, p_g=1) with a synthetic
Llama-shaped model named like a megatron-core GPTModel (random weights; the default is
about 40 MB in fp32), it measures one weight sync, train -> generate -> train, two ways:

* streaming (megaflow's route): ``MicroDPResharder.to_generation`` (all-gather inside the
  gather group, broadcast over the folded stages), then
  :func:`~megaflow.hybrid_engine.rollout_weights.iter_vllm_buckets` converts the generation
  shard to vLLM's local layout and hands it out in buckets of ``--bucket-mb`` MiB, each
  copied into a stand-in engine (preallocated tensors of vLLM's shard shapes) and dropped;
* naive: all-gather every parameter over the whole training TP group, broadcast every
  stage to the whole PP group (each rank then holds the full model), keep the generation
  slice, convert every tensor into a list (all materialised), then copy into the engine.

Both push the same tensors into the engine (checked bit for bit). Per rank it reports:

* bytes moved: received by the reshard (measured, and ``reshard_cost``'s formulas) plus the
  vocabulary all-gather of the conversion at t_g > 1;
* peak extra memory during the sync, measured by :class:`TensorAllocationTracker`, a
  tracemalloc for tensors: a ``TorchDispatchMode`` sees every aten op the sync runs; an
  op output whose storage is neither an input's nor already tracked is a new allocation
  (``untyped_storage().nbytes()``), and it counts as released when the last tensor object
  referring to that storage is garbage collected (a ``weakref.finalize`` per tensor).
  Views and in-place writes (the all-gather into its buffer, the engine's ``copy_``)
  allocate nothing. It is an upper bound on the sync's own allocations: the training
  storage that aliasing releases is not credited, and the collective library's internal
  buffers are outside it (gloo's all-gather stages through temporaries on its own
  threads; NCCL writes in place). ``torch.profiler``'s memory events are not used because
  they miss releases made on other threads and of blocks allocated before profiling.
  The target for the streaming route is at most the generation shard plus one bucket;
* time: the median over ``--repeats`` unprofiled syncs.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaflow.hybrid_engine import (
    MicroDPResharder,
    build_reshard_groups,
    gather_layout_to_shard,
    plan_hybrid_layout,
    reshard_cost,
)
from megaflow.hybrid_engine.params import describe_local_params
from megaflow.hybrid_engine.rollout_weights import (
    gather_rows,
    generation_buckets,
    iter_vllm_buckets,
    to_vllm_shard,
    vllm_param_name,
    vocab_row_transfers,
)
from megaflow.hybrid_engine.transport import load_buckets
from megaflow.models.hf_mapping import ModelSpec
from megaflow.topology.weight_sync import VLLM_VOCAB_PADDING, weight_sync_peak_bytes
from megaflow.utils.launch import run_distributed

TP, PP, DP = 2, 2, 1
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def synthetic_stage(args, pp_rank: int, tp_rank: int) -> dict[str, torch.Tensor]:
    """Random megatron-named TP shard of one stage (local layer indices)."""
    g = torch.Generator().manual_seed(1000 * pp_rank + tp_rank)
    h, hd, heads, kv = args.hidden, args.head_dim, args.heads, args.kv_heads
    layers = args.layers // PP

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    out = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = rnd(args.vocab // TP, h)
    for i in range(layers):
        p = f"decoder.layers.{i}."
        out[p + "input_layernorm.weight"] = rnd(h)
        out[p + "self_attention.linear_qkv.weight"] = rnd((heads + 2 * kv) * hd // TP, h)
        out[p + "self_attention.linear_proj.weight"] = rnd(h, heads * hd // TP)
        out[p + "pre_mlp_layernorm.weight"] = rnd(h)
        out[p + "mlp.linear_fc1.weight"] = rnd(2 * args.ffn // TP, h)
        out[p + "mlp.linear_fc2.weight"] = rnd(h, args.ffn // TP)
    if pp_rank == PP - 1:
        out["decoder.final_layernorm.weight"] = rnd(h)
        out["output_layer.weight"] = rnd(args.vocab // TP, h)
    return out


def model_bytes(args) -> int:
    """M: bytes of the unsharded fp32 model built by :func:`synthetic_stage`."""
    h, hd = args.hidden, args.head_dim
    layer = ((args.heads + 2 * args.kv_heads) * hd * h + h * args.heads * hd
             + 3 * args.ffn * h + 2 * h)
    return 4 * (2 * args.vocab * h + args.layers * layer + h)


def _tp_slice(full: torch.Tensor, dim: int, stride: int, tp: int, rank: int) -> torch.Tensor:
    """Megatron TP shard ``rank`` of ``tp`` of a full tensor with ``stride`` blocks."""
    shape = list(full.shape)
    blocks = full.view(*shape[:dim], stride, shape[dim] // stride, *shape[dim + 1:])
    part = blocks.narrow(dim + 1, rank * shape[dim] // stride // tp, shape[dim] // stride // tp)
    shape[dim] //= tp
    return part.reshape(shape).contiguous()


def naive_transition(layout, params, metas, tp_group, pp_group, gen_tp_rank):
    """Gather the full model on every rank, keep the generation slice. Returns
    (generation tensors, bytes received, accounted peak bytes)."""
    me = layout.ranks[dist.get_rank()]
    received, held, works, full = 0, 0, [], {}
    for meta in metas:  # own stage: all-gather over the whole training TP group
        param = params[meta.local_name]
        if meta.partition_dim is None:
            full[meta.name] = (meta, param.data.view(-1), 1)
            continue
        buf = torch.empty(TP * meta.shard_numel)
        works.append(_all_gather_flat(buf, param.data.reshape(-1), group=tp_group,
                                      async_op=True))
        received += (TP - 1) * meta.shard_nbytes
        held += TP * meta.shard_nbytes
        full[meta.name] = (meta, buf, TP)
    for w in works:
        w.wait()
    stage_metas: list = [None] * PP
    dist.all_gather_object(stage_metas, metas, group=pp_group)
    works = []
    for stage, smetas in enumerate(stage_metas):  # every stage to the whole PP group
        src = layout.rank_of(me.tp_rank, stage, me.dp_rank)
        for meta in smetas:
            slots = TP if meta.partition_dim is not None else 1
            if stage == me.pp_rank:
                buf = full[meta.name][1]
            else:
                buf = torch.empty(slots * meta.shard_numel)
                received += buf.numel() * 4
                held += buf.numel() * 4
                full[meta.name] = (meta, buf, slots)
            works.append(dist.broadcast(buf, src=src, group=pp_group, async_op=True))
    for w in works:
        w.wait()
    gen = {}
    for name, (meta, buf, slots) in full.items():
        if meta.partition_dim is None:
            gen[name] = buf.view(meta.shard_shape)
            continue
        whole = gather_layout_to_shard(buf, meta.shard_shape, meta.partition_dim, meta.stride, slots)
        gen[name] = _tp_slice(whole, meta.partition_dim, meta.stride, layout.gen_tp, gen_tp_rank)
    return gen, received, held




def model_spec(args) -> ModelSpec:
    """The synthetic model's spec, read from an HF Llama config like a checkpoint's."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.ffn, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
                         vocab_size=args.vocab, tie_word_embeddings=False)
    config.architectures = ["LlamaForCausalLM"]
    return ModelSpec.from_hf_config(config.to_dict())


class TensorAllocationTracker(TorchDispatchMode):
    """Peak bytes of tensor storage allocated (and not yet released) inside the ``with`` block.

    See the module docstring for what counts. ``peak`` and ``current`` are in bytes.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = self.peak = 0
        self._storages: dict[int, list[int]] = {}  # data_ptr -> [nbytes, live tensor objects]
        self._seen: set[int] = set()                 # id() of tensor objects with a finalizer

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, inputs)
        return out

    def _track(self, tensor: torch.Tensor, inputs: set[int]) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or id(tensor) in self._seen:
            return
        entry = self._storages.get(ptr)
        if entry is None:
            if ptr in inputs:
                return  # a view or an in-place result of storage allocated elsewhere
            entry = self._storages[ptr] = [storage.nbytes(), 0]
            self.current += entry[0]
            self.peak = max(self.peak, self.current)
        entry[1] += 1
        self._seen.add(id(tensor))
        weakref.finalize(tensor, self._release, ptr, id(tensor))

    def _release(self, ptr: int, key: int) -> None:
        self._seen.discard(key)
        entry = self._storages.get(ptr)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self._storages[ptr]


class SleepingEngine:
    """Stand-in for a vLLM engine that sleeps at level 2 between rollouts: its weights are
    discarded after generation and re-allocated when a weight update opens (the wake),
    one tensor per vLLM parameter; the streamed-update interface of
    :class:`~megaflow.rollout.vllm_rollout.VLLMRollout` (what ``load_buckets`` calls)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        self.shapes, self.dtype, self.device = shapes, dtype, torch.device(device)
        self.params: dict[str, torch.Tensor] = {}
        #: called with the weights just before a sleep discards them (a benchmark keeps them to compare routes)
        self.on_sleep: Callable[[dict[str, torch.Tensor]], None] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of the engine's weights when awake."""
        return sum(math.prod(s) for s in self.shapes.values()) * self.dtype.itemsize

    def begin_weight_update(self) -> None:
        self.params = {name: torch.zeros(shape, dtype=self.dtype, device=self.device)
                       for name, shape in self.shapes.items()}

    def load_weight_bucket(self, bucket) -> None:
        for name, tensor in bucket:
            self.params[name].copy_(tensor)

    def finish_weight_update(self) -> None:
        pass

    def abort_weight_update(self) -> None:
        pass

    def sleep(self) -> None:
        """Level 2: the weights are discarded (the next sync rewrites them)."""
        if self.on_sleep is not None:
            self.on_sleep(self.params)
        self.params = {}


def _vllm_shapes(resharder, spec, gen_tp: int) -> dict[str, tuple[int, ...]]:
    """vLLM's local shard shapes: the generation shard's, vocabulary rows re-padded to 64."""
    vocab_rows = -(-spec.vocab_size // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING // gen_tp
    shapes = {}
    with resharder.generation():
        for name, tensor in resharder.named_generation_tensors():
            target = vllm_param_name(name, spec)
            if target is not None:
                vocab = name in ("embedding.word_embeddings.weight", "output_layer.weight")
                shapes[target] = (vocab_rows, tensor.shape[1]) if vocab else tuple(tensor.shape)
    return shapes


def _gatherer(group, spec, counter: list):
    """The old conversion's vocabulary exchange: an all-gather of the whole padded vocabulary
    over the generation TP group, then vLLM's rows cut out; counts the bytes received."""
    def exchange(shard: torch.Tensor, vllm_rows: int) -> torch.Tensor:
        if group is not None:
            counter[0] += (dist.get_world_size(group) - 1) * shard.numel() * shard.element_size()
        full = gather_rows(shard, group)
        rank = 0 if group is None else dist.get_rank(group)
        out = full.new_zeros((vllm_rows, *full.shape[1:]))
        real = max(0, min(spec.vocab_size, (rank + 1) * vllm_rows) - rank * vllm_rows)
        out[:real] = full[rank * vllm_rows:rank * vllm_rows + real]
        return out
    return exchange


def vocab_exchange_bytes(group, spec, shard_rows: int, vllm_rows: int, hidden: int, matrices: int) -> int:
    """Bytes this rank receives in the streamed route's point-to-point vocabulary exchange."""
    if group is None or shard_rows == vllm_rows:
        return 0
    rank = dist.get_rank(group)
    rows = sum(n for src, dst, _, _, n in vocab_row_transfers(dist.get_world_size(group), shard_rows, vllm_rows,
                                                               spec.vocab_size) if dst == rank != src)
    return matrices * rows * hidden * 4


def streaming_sync(resharder, spec, engine, gen_tp_rank, bucket_bytes):
    """megaflow's route (the worker's sync): wake the engine, then gather, convert and load
    one bucket at a time. Returns (reshard stats, number of buckets, largest bucket bytes)."""
    buckets = generation_buckets(resharder, spec, gen_tp_rank=gen_tp_rank, vllm_shapes=engine.shapes,
                                 bucket_bytes=bucket_bytes)
    num, _, largest = load_buckets(engine, buckets)
    engine.sleep()
    return resharder.last_stats, num, largest


def gather_first_sync(resharder, spec, engine, gen_tp_rank, bucket_bytes, counter):
    """megaflow's route before issue 31: the whole generation shard gathered first, the engine
    woken after it, the vocabulary all-gathered. Returns the reshard stats."""
    with resharder.generation() as stats:
        load_buckets(engine, iter_vllm_buckets(resharder.named_generation_tensors(), spec,
                                               gen_tp=resharder.layout.gen_tp, gen_tp_rank=gen_tp_rank,
                                               vllm_shapes=engine.shapes,
                                               exchange_vocab=_gatherer(resharder.groups.gen_tp, spec, counter),
                                               bucket_bytes=bucket_bytes))
    engine.sleep()
    return stats


def largest_generation_tensor(resharder) -> int:
    """Bytes of the largest tensor of this rank's generation shard (its gathered buffer)."""
    return max(math.prod(shape) * dtype.itemsize for shape, dtype in resharder.generation_shapes().values())


def naive_sync(layout, params, metas, order, tp_group, pp_group, gen_tp_group, spec, engine, gen_tp_rank, counter):
    """Gather everything, convert everything into a list, then wake the engine and load;
    returns bytes received. ``metas``: this stage's parameters; ``order``: every stage's,
    in generation order."""
    gen, received, _ = naive_transition(layout, params, metas, tp_group, pp_group, gen_tp_rank)
    converted = [to_vllm_shard(name, gen[name], spec, gen_tp=layout.gen_tp, gen_tp_rank=gen_tp_rank,
                               vllm_shapes=engine.shapes, exchange_vocab=_gatherer(gen_tp_group, spec, counter))
                 for name in sorted(gen, key=_generation_order(order))]
    engine.begin_weight_update()
    engine.load_weight_bucket([c for c in converted if c is not None])
    engine.sleep()
    return received


def _generation_order(metas):
    order = {m.name: i for i, m in enumerate(metas)}
    return lambda name: order.get(name, len(order))


ROUTES = ("stream", "gather_first", "naive")
ROUTE_LABELS = {"stream": "streaming", "gather_first": "gather-1st", "naive": "naive"}


def sync_bound(resharder, engine, bucket_bytes: int, shard_bytes: int) -> int:
    """The streamed sync's peak by :func:`~megaflow.topology.weight_sync.weight_sync_peak_bytes`
    less the actor's shard (allocated before the measurement): engine + one bucket + the
    largest tensor, gathered (Megatron layout) or converted (vLLM's, whose vocabulary
    padding may be larger)."""
    largest = max(largest_generation_tensor(resharder),  # the gathered side, or vLLM's (its vocabulary padding)
                  max(math.prod(shape) for shape in engine.shapes.values()) * engine.dtype.itemsize)
    return int(weight_sync_peak_bytes(actor_shard=shard_bytes, engine_weights=engine.nbytes, bucket_bytes=bucket_bytes,
                                      largest_tensor=largest)) - shard_bytes


def _rank_main(rank: int, world_size: int, args) -> dict:
    layout = plan_hybrid_layout(TP, PP, DP, gen_tp=args.gen_tp, num_attention_heads=args.heads,
                                num_query_groups=args.kv_heads)
    me = layout.ranks[rank]
    spec = model_spec(args)
    params = synthetic_stage(args, me.pp_rank, me.tp_rank)
    groups = build_reshard_groups(layout)
    resharder = MicroDPResharder(groups, params)
    tp_groups = [dist.new_group(list(g)) for g in layout.train_tp_groups]
    pp_groups = [dist.new_group(list(g)) for g in layout.train_pp_groups]
    tp_group = tp_groups[[i for i, g in enumerate(layout.train_tp_groups) if rank in g][0]]
    pp_group = pp_groups[[i for i, g in enumerate(layout.train_pp_groups) if rank in g][0]]
    metas = describe_local_params(params, tp=TP, layer_offset=me.pp_rank * (args.layers // PP),
                                  gated_linear_unit=True)
    all_metas: list = [None] * world_size  # every stage's names, in generation order (stage 0 first)
    dist.all_gather_object(all_metas, (me.pp_rank, metas))
    order = [m for stage in range(PP) for m in next(ms for s, ms in all_metas if s == stage)]
    shapes = _vllm_shapes(resharder, spec, args.gen_tp)
    bucket_bytes = int(args.bucket_mb * 2 ** 20)
    engines = {kind: SleepingEngine(shapes) for kind in ROUTES}
    vocab = {kind: [0] for kind in ROUTES}
    loaded: dict[str, dict[str, torch.Tensor]] = {}
    out: dict = {"shard_bytes": sum(t.numel() * t.element_size() for t in params.values())}

    def run(kind: str):
        engine = engines[kind]
        if kind == "stream":
            return streaming_sync(resharder, spec, engine, me.gen_tp_rank, bucket_bytes)
        if kind == "gather_first":
            return gather_first_sync(resharder, spec, engine, me.gen_tp_rank, bucket_bytes, vocab[kind])
        return naive_sync(layout, params, metas, order, tp_group, pp_group, groups.gen_tp, spec, engine,
                          me.gen_tp_rank, vocab[kind])

    def keep(kind: str):  # what the engine held, for the bit-for-bit comparison (before it sleeps)
        engines[kind].on_sleep = lambda params: loaded.__setitem__(kind, dict(params))

    for kind in ROUTES:  # peak memory: one tracked sync each, the engine's wake inside it
        keep(kind)
        dist.barrier()
        with TensorAllocationTracker() as tracker:
            result = run(kind)
        out[f"{kind}_peak"] = tracker.peak
        if kind == "stream":
            stats, out["buckets"], out["largest_bucket"] = result
            out["stream_bytes"] = stats.bytes_received
            out["generation_bytes"] = stats.generation_bytes
        elif kind == "gather_first":
            out["gather_first_bytes"] = result.bytes_received
        else:
            out["naive_bytes"] = result
        out[f"{kind}_vocab_bytes"] = vocab[kind][0]
    vocab_rows = shapes["model.embed_tokens.weight"][0]
    out["stream_vocab_bytes"] = vocab_exchange_bytes(groups.gen_tp, spec, args.vocab // TP * TP // args.gen_tp,
                                                     vocab_rows, args.hidden, 2)
    for kind in ROUTES[1:]:
        for name in shapes:
            if not torch.equal(loaded["stream"][name], loaded[kind][name]):
                raise AssertionError(f"rank {rank}: the streamed and {kind} syncs loaded different {name!r}")
    out["bound"] = sync_bound(resharder, engines["stream"], bucket_bytes, out["shard_bytes"])
    out["engine_bytes"] = engines["stream"].nbytes
    for kind in ROUTES:
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            run(kind)
            times.append(time.perf_counter() - start)
        out[f"{kind}_time"] = statistics.median(times) if times else float("nan")
    return out


def report(args) -> None:
    """Run one layout (``args.gen_tp``) on 4 ranks and print the side-by-side table."""
    results = run_distributed(_rank_main, TP * PP * DP, args, timeout_s=900)
    M = model_bytes(args)
    cost = reshard_cost(plan_hybrid_layout(TP, PP, DP, gen_tp=args.gen_tp), M)
    mib = 2 ** 20
    worst = {k: max(r[k] for r in results) for k in results[0]}
    print(f"\nmodel M = {M / mib:.1f} MiB fp32; training t={TP} p={PP} d={DP} -> generation t_g={args.gen_tp} "
          f"p_g=1 on {TP * PP * DP} gloo CPU ranks; buckets of {args.bucket_mb:g} MiB (max over ranks); "
          f"peak: tensors allocated during the sync, the engine's wake included (actor shard excluded)")
    print(f"{'':>10} {'reshard MiB':>12} {'formula MiB':>12} {'vocab MiB':>10} {'peak MiB':>9} {'bound MiB':>10} "
          f"{'time s':>8}")
    formulas = {"stream": cost.micro_dp_bytes, "gather_first": cost.micro_dp_bytes, "naive": cost.naive_bytes}
    for kind in ROUTES:
        peak = worst[kind + "_peak"]
        print(f"{ROUTE_LABELS[kind]:>10} {worst[kind + '_bytes'] / mib:>12.2f} {formulas[kind] / mib:>12.2f} "
              f"{worst[kind + '_vocab_bytes'] / mib:>10.2f} {peak / mib:>9.2f} {worst['bound'] / mib:>10.2f} "
              f"{worst[kind + '_time']:>8.3f}  {'within' if peak <= worst['bound'] else 'ABOVE'}")
    print(f"streaming: {worst['buckets']} buckets per rank, largest {worst['largest_bucket'] / mib:.2f} MiB; "
          f"bound = engine weights {worst['engine_bytes'] / mib:.2f} MiB + one bucket + the largest generation "
          f"tensor (megaflow.topology.weight_sync)")
    print(f"ratio gather-first/streaming: peak memory "
          f"{worst['gather_first_peak'] / max(worst['stream_peak'], 1):.2f}x, "
          f"time {worst['gather_first_time'] / worst['stream_time']:.2f}x; naive/streaming: bytes "
          f"{worst['naive_bytes'] / max(worst['stream_bytes'], 1):.2f}x, "
          f"peak memory {worst['naive_peak'] / max(worst['stream_peak'], 1):.2f}x")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gen-tp", type=int, default=None, help="generation TP (divides 2); default: 2 and 1")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8, help="even: split over 2 stages")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--bucket-mb", type=float, default=2.0, help="weight-sync bucket size in MiB")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.bucket_mb <= 0:
        parser.error(f"--bucket-mb must be > 0, got {args.bucket_mb}")
    for gen_tp in ([args.gen_tp] if args.gen_tp else [2, 1]):
        report(argparse.Namespace(**{**vars(args), "gen_tp": gen_tp}))


if __name__ == "__main__":
    main()
