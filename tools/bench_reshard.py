#!/usr/bin/env python
"""Benchmark the 3D-HybridEngine reshard against the naive gather-everything baseline.

    python tools/bench_reshard.py                     # 4 CPU ranks, t=2 p=2 -> t_g=2
    python tools/bench_reshard.py --gen-tp 1 --hidden 512 --repeats 5

On 4 gloo ranks (training t=2, p=2, d=1; generation t_g, p_g=1) with a synthetic
Llama-shaped model named like a megatron-core GPTModel (random weights; the default is
about 40 MB in fp32), it measures the train -> generate transition two ways:

* micro-DP (HybridFlow section 5): ``MicroDPResharder.to_generation`` — all-gather inside
  the gather group, broadcast over the folded stages — plus materialising every
  generation tensor in megatron TP = t_g layout;
* naive: all-gather every parameter over the whole training TP group, broadcast every
  stage to the whole PP group (each rank then holds the full model), and keep the
  generation slice.

Both produce the same generation shard (checked bit for bit). It prints per-rank bytes
received (measured, and the DESIGN.md formulas), peak weight memory per rank (accounted:
micro-DP holds the generation shard, which contains the training shard; naive holds the
training shard plus the full model) and the median transition time over ``--repeats``
runs, with naive / micro-DP ratios, from one run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megaflow.hybrid_engine import (MicroDPResharder, build_reshard_groups,  # noqa: E402
                                    gather_layout_to_shard, plan_hybrid_layout, reshard_cost)
from megaflow.hybrid_engine.params import describe_local_params  # noqa: E402
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


def _rank_main(rank: int, world_size: int, args) -> dict:
    layout = plan_hybrid_layout(TP, PP, DP, gen_tp=args.gen_tp, num_attention_heads=args.heads,
                                num_query_groups=args.kv_heads)
    me = layout.ranks[rank]
    params = synthetic_stage(args, me.pp_rank, me.tp_rank)
    resharder = MicroDPResharder(build_reshard_groups(layout), params)
    tp_groups = [dist.new_group(list(g)) for g in layout.train_tp_groups]
    pp_groups = [dist.new_group(list(g)) for g in layout.train_pp_groups]
    tp_group = tp_groups[[i for i, g in enumerate(layout.train_tp_groups) if rank in g][0]]
    pp_group = pp_groups[[i for i, g in enumerate(layout.train_pp_groups) if rank in g][0]]
    metas = describe_local_params(params, tp=TP, layer_offset=me.pp_rank * (args.layers // PP),
                                  gated_linear_unit=True)
    micro_times, naive_times = [], []
    for _ in range(args.repeats):
        dist.barrier()
        start = time.perf_counter()
        stats = resharder.to_generation()
        micro_gen = {n: t.contiguous() for n, t in resharder.named_generation_tensors()}
        micro_times.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        naive_gen, naive_bytes, naive_held = naive_transition(layout, params, metas, tp_group,
                                                              pp_group, me.gen_tp_rank)
        naive_times.append(time.perf_counter() - start)
        if sorted(micro_gen) != sorted(naive_gen) or any(
                not torch.equal(micro_gen[n], naive_gen[n]) for n in micro_gen):
            raise AssertionError(f"rank {rank}: micro-DP and naive generation shards differ")
        del micro_gen, naive_gen
        resharder.to_training()
    shard_bytes = sum(t.numel() * t.element_size() for t in params.values())
    return dict(micro_bytes=stats.bytes_received, micro_peak=stats.generation_bytes,
                micro_time=statistics.median(micro_times), naive_bytes=naive_bytes,
                naive_peak=naive_held + shard_bytes, naive_time=statistics.median(naive_times),
                shard_bytes=shard_bytes)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gen-tp", type=int, default=2, help="generation TP (divides 2)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8, help="even: split over 2 stages")
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    results = run_distributed(_rank_main, TP * PP * DP, args, timeout_s=600)
    M = model_bytes(args)
    cost = reshard_cost(plan_hybrid_layout(TP, PP, DP, gen_tp=args.gen_tp), M)
    mib = 2 ** 20
    worst = {k: max(r[k] for r in results) for k in results[0]}
    print(f"model M = {M / mib:.1f} MiB fp32; training t={TP} p={PP} d={DP} -> generation "
          f"t_g={args.gen_tp} p_g=1 on {TP * PP * DP} gloo CPU ranks (max over ranks)")
    print(f"{'':>10} {'recv MiB/rank':>14} {'formula MiB':>12} {'peak MiB':>9} {'time s':>8}")
    print(f"{'micro-DP':>10} {worst['micro_bytes'] / mib:>14.2f} {cost.micro_dp_bytes / mib:>12.2f} "
          f"{worst['micro_peak'] / mib:>9.2f} {worst['micro_time']:>8.3f}")
    print(f"{'naive':>10} {worst['naive_bytes'] / mib:>14.2f} {cost.naive_bytes / mib:>12.2f} "
          f"{worst['naive_peak'] / mib:>9.2f} {worst['naive_time']:>8.3f}")
    print(f"ratio naive/micro-DP: bytes {worst['naive_bytes'] / worst['micro_bytes']:.2f}x, "
          f"peak memory {worst['naive_peak'] / worst['micro_peak']:.2f}x, "
          f"time {worst['naive_time'] / worst['micro_time']:.2f}x")


if __name__ == "__main__":
    main()
