"""Micro-DP resharding on 4 gloo ranks against slices of a full synthetic model.

Every rank rebuilds the full model from a seed, derives its megatron training shard
(hybrid_synthetic.py builds shards from unfused q/k/v/gate/up, independently of megaflow),
reshards, and compares each generation tensor bit for bit with the megatron TP = t_g
shard cut from the full model. All scenarios run in one spawned world (module fixture).
"""
import dataclasses
import re

import pytest
import torch

from hybrid_synthetic import (TinyConfig, full_components, generation_shard, model_bytes,
                              training_shard)
from megaflow.hybrid_engine import (MicroDPResharder, build_reshard_groups, plan_hybrid_layout,
                                    reshard_cost)
from megaflow.utils.launch import run_distributed

UNIFORM = TinyConfig(norms=False)  # every parameter TP-partitioned, equal stages
FULL = TinyConfig(layers_per_stage=(1, 3), tied=True)  # norms, uneven stages, tied
FULL_UNTIED = TinyConfig(layers_per_stage=(3, 1))


@dataclasses.dataclass(frozen=True)
class Scenario:
    key: str
    tp: int
    pp: int
    dp: int
    gen_tp: int
    gen_pp: int
    cfg: TinyConfig
    shared_storage: bool = False  # params are views of one flat buffer (DDP param buffer)


SCENARIOS = [
    Scenario("t2p2-tg2-uniform", 2, 2, 1, 2, 1, UNIFORM),
    Scenario("t2p2-tg1-uniform", 2, 2, 1, 1, 1, UNIFORM),
    Scenario("t2p2-tg2-full", 2, 2, 1, 2, 1, FULL),
    Scenario("t2p2-tg1-full", 2, 2, 1, 1, 1, FULL_UNTIED),
    Scenario("t2p2-tg1pg2-full", 2, 2, 1, 1, 2, FULL_UNTIED),
    Scenario("t4p1-tg2-uniform-shared", 4, 1, 1, 2, 1, TinyConfig(layers_per_stage=(2,), norms=False),
             shared_storage=True),
    Scenario("t2p1d2-tg1-full", 2, 1, 2, 1, 1, TinyConfig(layers_per_stage=(2,))),
]


def _as_views_of_one_buffer(params: dict) -> dict:
    flat = torch.cat([t.reshape(-1) for t in params.values()])
    out, offset = {}, 0
    for name, t in params.items():
        out[name] = flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
    return out


def _compare(resharder, expected: dict) -> list[str]:
    bad = [n for n in expected if not torch.equal(resharder.generation_tensor(n), expected[n])]
    if sorted(resharder.generation_names()) != sorted(expected):
        bad.append(f"names {sorted(resharder.generation_names())} != {sorted(expected)}")
    return bad


def _run_scenario(rank: int, sc: Scenario) -> dict:
    layout = plan_hybrid_layout(sc.tp, sc.pp, sc.dp, gen_tp=sc.gen_tp, gen_pp=sc.gen_pp,
                                num_attention_heads=sc.cfg.heads, num_query_groups=sc.cfg.kv_heads)
    me = layout.ranks[rank]
    comps = full_components(sc.cfg)
    params = training_shard(sc.cfg, comps, tp=sc.tp, tp_rank=me.tp_rank, pp_rank=me.pp_rank)
    if sc.shared_storage:
        params = _as_views_of_one_buffer(params)
    originals = {n: t.clone() for n, t in params.items()}
    ptrs = {n: t.data_ptr() for n, t in params.items()}
    resharder = MicroDPResharder(build_reshard_groups(layout), params,
                                 share_embeddings_and_output_weights=sc.cfg.tied)
    stages = range(me.gen_pp_rank * layout.pp_ratio, (me.gen_pp_rank + 1) * layout.pp_ratio)
    stats = resharder.to_generation()
    expected = generation_shard(sc.cfg, comps, gen_tp=sc.gen_tp, gen_tp_rank=me.gen_tp_rank, stages=stages)
    offset = sum(sc.cfg.layers_per_stage[:me.pp_rank])
    as_global = lambda n: re.sub(r"layers\.(\d+)\.", lambda m: f"layers.{int(m.group(1)) + offset}.", n)  # noqa: E731
    held = sum(t.numel() * t.element_size() for n, t in params.items() if as_global(n) in expected)
    out = {"stats": stats, "num_params": len(params), "M": model_bytes(sc.cfg, comps),
           # what the rank lacks: its generation shard less the part its training shard already holds
           "expected_received": sum(t.numel() * t.element_size() for t in expected.values()) - held,
           "shard_bytes": sum(t.numel() * t.element_size() for t in params.values()),
           "mismatch": _compare(resharder, expected)}
    # alias: the training QKV shard lives inside the generation buffer (same storage)
    qkv = next(n for n in params if n.endswith("linear_qkv.weight"))
    local_layer = int(qkv.split(".")[2])
    gen_qkv = resharder.generation_tensor(
        qkv.replace(f"layers.{local_layer}.", f"layers.{local_layer + offset}."))
    out["qkv_same_storage"] = (params[qkv].untyped_storage().data_ptr()
                               == gen_qkv.untyped_storage().data_ptr())
    out["qkv_offset_ok"] = (params[qkv].data_ptr() - gen_qkv.data_ptr()
                            == (me.tp_rank % layout.tp_ratio) * params[qkv].numel() * 4)
    resharder.to_training()
    out["restored"] = [n for n in params if not torch.equal(params[n], originals[n])]
    out["own_storage"] = all(p.untyped_storage().nbytes() == p.numel() * p.element_size()
                             for p in params.values()) or sc.shared_storage
    out["ptrs_kept"] = all(params[n].data_ptr() == ptrs[n] for n in params)
    # training continues: an in-place update (an optimizer step) reaches the next rollout
    for p in params.values():
        p.data.add_(1.0)
    with resharder.generation():
        bumped = {k: v + 1.0 for k, v in comps.items()}
        if sc.cfg.tied:
            bumped["output"] = bumped["embed"]
        out["mismatch_after_update"] = _compare(resharder, generation_shard(
            sc.cfg, bumped, gen_tp=sc.gen_tp, gen_tp_rank=me.gen_tp_rank, stages=stages))
    out["restored_after_update"] = [n for n in params if not torch.equal(params[n], originals[n] + 1)]
    # the streamed route (the weight sync's): one tensor gathered per fetch, the same tensors
    expected = generation_shard(sc.cfg, bumped, gen_tp=sc.gen_tp, gen_tp_rank=me.gen_tp_rank, stages=stages)
    before = {n: t.data_ptr() for n, t in params.items()}
    streamed = {name: pending.fetch().clone() for name, pending in resharder.stream_generation_tensors()}
    out["stream_mismatch"] = sorted(n for n in set(expected) | set(streamed)
                                    if n not in streamed or n not in expected or not torch.equal(streamed[n], expected[n]))
    out["stream_stats"] = resharder.last_stats
    out["largest_generation_tensor"] = max(t.numel() * t.element_size() for t in expected.values())
    out["params_kept_by_stream"] = all(torch.equal(params[n], originals[n] + 1) and params[n].data_ptr() == before[n]
                                       for n in params)
    return out


def _misuse(rank: int) -> dict:
    """Each misuse raises on every rank before any collective (so nothing hangs)."""
    errors = {}

    def record(key, fn, exc):
        try:
            fn()
        except exc as e:  # noqa: PERF203
            errors[key] = str(e)

    record("world", lambda: build_reshard_groups(plan_hybrid_layout(2, 1, 1, gen_tp=1)), ValueError)
    layout = plan_hybrid_layout(2, 2, 1, gen_tp=1)
    me = layout.ranks[rank]
    params = training_shard(UNIFORM, full_components(UNIFORM), tp=2, tp_rank=me.tp_rank,
                            pp_rank=me.pp_rank)
    resharder = MicroDPResharder(build_reshard_groups(layout), params)
    record("train_first", resharder.to_training, RuntimeError)
    record("tensor_first", lambda: resharder.generation_tensor("output_layer.weight"), RuntimeError)
    resharder.to_generation()
    record("twice", resharder.to_generation, RuntimeError)
    record("unknown", lambda: resharder.generation_tensor("decoder.layers.9.x"), KeyError)
    resharder.to_training()
    return errors


def _run_all(rank: int, world_size: int, scenarios) -> dict:
    out = {sc.key: _run_scenario(rank, sc) for sc in scenarios}
    out["misuse"] = _misuse(rank)
    return out


@pytest.fixture(scope="module")
def results():
    per_rank = run_distributed(_run_all, 4, SCENARIOS, timeout_s=300)
    return {key: [r[key] for r in per_rank] for key in per_rank[0]}


def _scenario(key: str) -> Scenario:
    return next(sc for sc in SCENARIOS if sc.key == key)


@pytest.mark.slow
@pytest.mark.parametrize("key", [sc.key for sc in SCENARIOS])
def test_generation_shard_equals_slice_of_full_model(results, key):
    for rank, res in enumerate(results[key]):
        assert res["mismatch"] == [], (rank, res["mismatch"])
        assert res["mismatch_after_update"] == [], (rank, res["mismatch_after_update"])


@pytest.mark.slow
@pytest.mark.parametrize("key", [sc.key for sc in SCENARIOS])
def test_training_parameters_restored(results, key):
    sc = _scenario(key)
    for rank, res in enumerate(results[key]):
        assert res["restored"] == [] and res["restored_after_update"] == [], rank
        assert res["own_storage"], rank
        if sc.shared_storage:  # copied, never moved: megatron's param buffer stays valid
            assert res["ptrs_kept"], rank


@pytest.mark.slow
@pytest.mark.parametrize("key", [sc.key for sc in SCENARIOS])
def test_recorded_bytes_match_the_shard_difference_and_formula(results, key):
    sc = _scenario(key)
    layout = plan_hybrid_layout(sc.tp, sc.pp, sc.dp, gen_tp=sc.gen_tp, gen_pp=sc.gen_pp)
    res = results[key]
    assert sum(r["stats"].bytes_sent for r in res) == sum(r["stats"].bytes_received for r in res)
    for rank, r in enumerate(res):
        assert r["stats"].bytes_received == r["expected_received"], rank
    if sc.cfg.norms:
        return
    # megaflow.topology.hybrid_layout.reshard_cost (HybridFlow section 5): (t*p - t_g*p_g) / (t_g*p_g*t*p) * M, peak M / (t_g*p_g)
    M = res[0]["M"]
    t, p, tg, pg = sc.tp, sc.pp, sc.gen_tp, sc.gen_pp
    cost = reshard_cost(layout, M)
    for rank, r in enumerate(res):
        assert r["shard_bytes"] == M / (t * p)
        assert r["stats"].bytes_received == (t * p - tg * pg) * M / (tg * pg * t * p) == cost.micro_dp_bytes
        assert r["stats"].bytes_sent == r["stats"].bytes_received
        assert r["stats"].generation_bytes == M / (tg * pg)
        # aliasing releases the training storage; copies (shared storage) release nothing
        released = 0 if sc.shared_storage else M / (t * p)
        assert r["stats"].peak_extra_bytes == M / (tg * pg) - released


@pytest.mark.slow
def test_training_shard_aliases_generation_buffer(results):
    for key in ("t2p2-tg1-uniform", "t2p2-tg1-full", "t2p1d2-tg1-full"):
        for rank, r in enumerate(results[key]):
            assert r["qkv_same_storage"] and r["qkv_offset_ok"], (key, rank)
            assert r["stats"].num_copied == 0 and r["stats"].num_aliased > 0
    for rank, r in enumerate(results["t4p1-tg2-uniform-shared"]):
        assert not r["qkv_same_storage"], rank
        assert r["stats"].num_aliased == 0 and r["stats"].num_copied == r["num_params"]


@pytest.mark.slow
def test_misuse_raises_clear_errors(results):
    for rank, errors in enumerate(results["misuse"]):
        assert "world size 4 != tp*pp*dp = 2*1*1 = 2" in errors["world"], rank
        assert "to_training called while not in the generation layout" in errors["train_first"]
        assert "only between to_generation and to_training" in errors["tensor_first"]
        assert "to_generation called twice" in errors["twice"]
        assert "'decoder.layers.9.x' is not in this rank's generation shard" in errors["unknown"]


@pytest.mark.slow
@pytest.mark.parametrize("key", [sc.key for sc in SCENARIOS])
def test_streamed_generation_tensors_match_and_hold_one_tensor_at_a_time(results, key):
    for rank, r in enumerate(results[key]):
        assert r["stream_mismatch"] == [], (rank, r["stream_mismatch"])
        assert r["params_kept_by_stream"], rank  # no aliasing: the training storage is never moved
        stats = r["stream_stats"]
        assert stats.bytes_received == r["expected_received"], rank  # the same traffic as to_generation
        assert stats.generation_bytes == r["stats"].generation_bytes and stats.num_aliased == 0
        # one buffer alive at a time (to_generation holds them all: its peak is the whole shard less aliasing)
        assert 0 < stats.peak_extra_bytes <= r["largest_generation_tensor"], rank
