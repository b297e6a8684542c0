"""The streamed weight sync's measured peak against megaflow.topology.weight_sync's formula.

tools/bench_reshard.py runs the worker's sync (``generation_buckets`` loaded by
``load_buckets`` into an engine that re-allocates its weights when the update opens, as
vLLM's level-2 wake does) on 4 gloo ranks (t=2, p=2 -> t_g, p_g=1) under its live-tensor
tracker. The streamed route must stay within engine weights + one bucket + the largest
generation tensor (the actor's shard is allocated before the measurement); megaflow's
route before issue 31 (the whole generation shard gathered first, the engine woken after,
the vocabulary all-gathered) and the naive full gather must not, so the bound tells them
apart. All three load the same tensors (the tool checks it bit for bit).
"""
import argparse

import pytest

from toolslib import load_tool

bench = load_tool("bench_reshard")


def _args(gen_tp: int) -> argparse.Namespace:
    # vocab 1000: Megatron's 500 rows per rank vs vLLM's 512 (padded to 64): the rows are exchanged at t_g = 2
    return argparse.Namespace(gen_tp=gen_tp, hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=192, layers=4,
                              vocab=1000, bucket_mb=1 / 16, repeats=0)


@pytest.mark.slow
@pytest.mark.parametrize("gen_tp", [1, 2], ids=["tg1", "tg2"])
def test_streamed_sync_peak_is_within_the_formula_and_the_old_route_is_not(gen_tp):
    from megaflow.utils.launch import run_distributed

    results = run_distributed(bench._rank_main, 4, _args(gen_tp), timeout_s=600)
    bucket = int(_args(gen_tp).bucket_mb * 2 ** 20)
    for rank, r in enumerate(results):
        assert r["buckets"] > 2, rank  # the bucket is small against the shard: streaming is exercised
        assert r["largest_bucket"] <= max(bucket, r["bound"] - r["engine_bytes"] - bucket), rank
        assert r["stream_peak"] <= r["bound"], (rank, r["stream_peak"], r["bound"])
        assert r["engine_bytes"] <= r["stream_peak"], rank  # the engine's wake is inside the measurement
        assert r["gather_first_peak"] > r["bound"], (rank, r["gather_first_peak"], r["bound"])
        assert r["naive_peak"] > r["bound"], rank
        assert r["stream_bytes"] == r["gather_first_bytes"], rank  # the same reshard traffic
    if gen_tp == 2:  # rows exchanged point to point: no rank receives the full vocabulary
        assert all(r["stream_vocab_bytes"] < r["gather_first_vocab_bytes"] for r in results)
        assert any(r["stream_vocab_bytes"] > 0 for r in results)  # 12 of rank 0's 512 rows come from rank 1


def test_sync_bound_is_the_formula_less_the_actor_shard():
    from megaflow.topology.weight_sync import weight_sync_peak_bytes

    import torch

    class Engine:
        nbytes = 1000
        shapes = {"x": (5, 4)}
        dtype = torch.float32

    class Resharder:
        @staticmethod
        def generation_shapes():
            return {"a": ((10, 4), torch.float32), "b": ((3,), torch.float32)}

    assert bench.sync_bound(Resharder(), Engine(), 300, 77) == 1000 + 300 + 160
    Engine.shapes = {"x": (50, 4)}  # vLLM's largest tensor (vocabulary padding) above the gathered one
    assert bench.sync_bound(Resharder(), Engine(), 300, 77) == 1000 + 800 + 800  # the bucket is the tensor
    Engine.dtype = torch.bfloat16  # the engine's tensors in its own dtype: 2 bytes
    assert bench.sync_bound(Resharder(), Engine(), 300, 77) == 1000 + 400 + 400
    assert weight_sync_peak_bytes(actor_shard=77, engine_weights=1000, bucket_bytes=300, largest_tensor=160) == 1537
