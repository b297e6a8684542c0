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
import statistics
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaflow.hybrid_engine import (MicroDPResharder, build_reshard_groups,  # noqa: E402
                                    gather_layout_to_shard, plan_hybrid_layout, reshard_cost)
from megaflow.hybrid_engine.params import describe_local_params  # noqa: E402
from megaflow.hybrid_engine.rollout_weights import (gather_rows, iter_vllm_buckets, to_vllm_shard,  # noqa: E402
                                                     vllm_param_name)
from megaflow.models.hf_mapping import ModelSpec  # noqa: E402
from megaflow.utils.launch import run_distributed  # noqa: E402

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


#: vLLM pads the vocabulary of its embedding and LM head to a multiple of this
#: (``vllm.model_executor.layers.vocab_parallel_embedding.DEFAULT_VOCAB_PADDING_SIZE``).
VLLM_VOCAB_PADDING = 64


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


class _Engine:
    """Stand-in for the vLLM engine's weights: one preallocated tensor per vLLM parameter."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]):
        self.shapes = shapes
        self.params = {name: torch.zeros(shape) for name, shape in shapes.items()}

    def load(self, bucket) -> None:
        for name, tensor in bucket:
            self.params[name].copy_(tensor)


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


def _gatherer(group, counter: list):
    """The conversion's vocabulary all-gather over the generation TP group, counting bytes received."""
    def gather(shard: torch.Tensor) -> torch.Tensor:
        if group is not None:
            counter[0] += (dist.get_world_size(group) - 1) * shard.numel() * shard.element_size()
        return gather_rows(shard, group)
    return gather


def streaming_sync(resharder, spec, engine, gen_tp_rank, bucket_bytes, counter):
    """megaflow's route; returns (reshard stats, number of buckets, largest bucket bytes)."""
    buckets = largest = 0
    with resharder.generation() as stats:
        for bucket in iter_vllm_buckets(resharder.named_generation_tensors(), spec, gen_tp=resharder.layout.gen_tp,
                                        gen_tp_rank=gen_tp_rank, vllm_shapes=engine.shapes,
                                        gather_vocab=_gatherer(resharder.groups.gen_tp, counter),
                                        bucket_bytes=bucket_bytes):
            engine.load(bucket)
            buckets += 1
            largest = max(largest, sum(t.numel() * t.element_size() for _, t in bucket))
            del bucket
    return stats, buckets, largest


def naive_sync(layout, params, metas, order, tp_group, pp_group, gen_tp_group, spec, engine, gen_tp_rank, counter):
    """Gather everything, convert everything into a list, then load; returns bytes received.
    ``metas``: this stage's parameters; ``order``: every stage's, in generation order."""
    gen, received, _ = naive_transition(layout, params, metas, tp_group, pp_group, gen_tp_rank)
    converted = [to_vllm_shard(name, gen[name], spec, gen_tp=layout.gen_tp, gen_tp_rank=gen_tp_rank,
                               vllm_shapes=engine.shapes, gather_vocab=_gatherer(gen_tp_group, counter))
                 for name in sorted(gen, key=_generation_order(order))]
    engine.load([c for c in converted if c is not None])
    return received


def _generation_order(metas):
    order = {m.name: i for i, m in enumerate(metas)}
    return lambda name: order.get(name, len(order))


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
    stream_engine, naive_engine = _Engine(shapes), _Engine(shapes)
    stream_vocab, naive_vocab = [0], [0]
    out: dict = {}

    def run(kind: str):
        if kind == "stream":
            return streaming_sync(resharder, spec, stream_engine, me.gen_tp_rank, bucket_bytes, stream_vocab)
        return naive_sync(layout, params, metas, order, tp_group, pp_group, groups.gen_tp, spec, naive_engine,
                          me.gen_tp_rank, naive_vocab)

    for kind in ("stream", "naive"):  # peak memory: one tracked sync each
        dist.barrier()
        with TensorAllocationTracker() as tracker:
            result = run(kind)
        out[f"{kind}_peak"] = tracker.peak
        if kind == "stream":
            stats, out["buckets"], out["largest_bucket"] = result
            out["stream_bytes"] = stats.bytes_received
            out["generation_bytes"] = stats.generation_bytes
        else:
            out["naive_bytes"] = result
        out[f"{kind}_vocab_bytes"] = (stream_vocab if kind == "stream" else naive_vocab)[0]
    for name in shapes:
        if not torch.equal(stream_engine.params[name], naive_engine.params[name]):
            raise AssertionError(f"rank {rank}: streaming and naive syncs loaded different {name!r}")
    for kind in ("stream", "naive"):
        times = []
        for _ in range(args.repeats):
            dist.barrier()
            start = time.perf_counter()
            run(kind)
            times.append(time.perf_counter() - start)
        out[f"{kind}_time"] = statistics.median(times)
    out["shard_bytes"] = sum(t.numel() * t.element_size() for t in params.values())
    return out


def report(args) -> None:
    """Run one layout (``args.gen_tp``) on 4 ranks and print the side-by-side table."""
    results = run_distributed(_rank_main, TP * PP * DP, args, timeout_s=900)
    M = model_bytes(args)
    cost = reshard_cost(plan_hybrid_layout(TP, PP, DP, gen_tp=args.gen_tp), M)
    mib = 2 ** 20
    worst = {k: max(r[k] for r in results) for k in results[0]}
    target = max(r["generation_bytes"] + r["largest_bucket"] for r in results)
    print(f"\nmodel M = {M / mib:.1f} MiB fp32; training t={TP} p={PP} d={DP} -> generation t_g={args.gen_tp} "
          f"p_g=1 on {TP * PP * DP} gloo CPU ranks; buckets of {args.bucket_mb:g} MiB (max over ranks)")
    print(f"{'':>10} {'reshard MiB':>12} {'formula MiB':>12} {'vocab MiB':>10} {'peak extra MiB':>15} "
          f"{'time s':>8}")
    for kind, formula in (("stream", cost.micro_dp_bytes), ("naive", cost.naive_bytes)):
        print(f"{'streaming' if kind == 'stream' else 'naive':>10} {worst[kind + '_bytes'] / mib:>12.2f} "
              f"{formula / mib:>12.2f} {worst[kind + '_vocab_bytes'] / mib:>10.2f} "
              f"{worst[kind + '_peak'] / mib:>15.2f} {worst[kind + '_time']:>8.3f}")
    print(f"streaming: {worst['buckets']} buckets per rank, largest {worst['largest_bucket'] / mib:.2f} MiB; "
          f"target peak <= generation shard + one bucket = {target / mib:.2f} MiB: "
          f"{'met' if worst['stream_peak'] <= target else 'MISSED'}")
    print(f"ratio naive/streaming: bytes {worst['naive_bytes'] / max(worst['stream_bytes'], 1):.2f}x, "
          f"peak memory {worst['naive_peak'] / max(worst['stream_peak'], 1):.2f}x, "
          f"time {worst['naive_time'] / worst['stream_time']:.2f}x")


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
