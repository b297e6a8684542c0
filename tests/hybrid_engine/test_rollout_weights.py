"""The weight sync's conversion: megatron-core generation shards -> vLLM's local shards, in buckets.

Expected tensors are cut from full Hugging Face tensors by ``rollout_testlib.hf_llama_to_vllm_shards``
(vLLM's per-rank layout written out by hand: q heads then k then v, gate rows then up rows,
vocabulary padded to 64 rows), independently of the Megatron side, whose TP = t_g shards are
built by the loader's :func:`~megaflow.models.hf_mapping.hf_to_megatron_shard`. Both ranks of
a t_g = 2 group are simulated in this process (the vocabulary exchange copies the rows
:func:`~megaflow.hybrid_engine.rollout_weights.vocab_row_transfers` names from the other
rank's shard; the 2-process test below runs the real point-to-point exchange).
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from megaflow.hybrid_engine.rollout_weights import (VLLM_PACKED_MODULES, exchange_vocab_rows, iter_vllm_buckets,
                                                     vllm_param_name, vocab_row_transfers)
from megaflow.models.hf_mapping import (PARAM_MAPPINGS, ModelSpec, ShardLayout, hf_names, hf_shape,
                                        hf_to_megatron_shard, is_active)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
from rollout_testlib import hf_llama_to_vllm_shards  # noqa: E402 - vLLM's layout, written out by hand

TRAIN_TP = 2
VOCAB = 100  # neither a multiple of 64 (vLLM) nor of 256 (Megatron at t = 2)


def _spec(tied: bool, qkv_bias: bool = False, vocab: int = VOCAB) -> ModelSpec:
    """A tiny GQA Llama (Qwen2 with ``qkv_bias``), read from its HF config like any checkpoint."""
    from transformers import LlamaConfig, Qwen2Config

    sizes = dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=vocab, tie_word_embeddings=tied)
    config = Qwen2Config(**sizes) if qkv_bias else LlamaConfig(**sizes)
    config.architectures = ["Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"]
    return ModelSpec.from_hf_config(config.to_dict())


def _hf_state(spec: ModelSpec) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    names = [n for row in PARAM_MAPPINGS if is_active(row, spec)
             for layer in (range(spec.num_layers) if row.per_layer else [None])
             for n in hf_names(row, spec, layer)]
    return {n: torch.randn(hf_shape(n, spec), generator=gen) for n in dict.fromkeys(names)}


def _megatron_generation_shards(spec: ModelSpec, hf: dict, gen_tp: int, rank: int) -> list[tuple[str, torch.Tensor]]:
    """What the resharder yields on generation TP rank ``rank``: TP = gen_tp shards, global
    layer names, the vocabulary padded for the *training* TP (Megatron: a multiple of 128 * t),
    the padding rows non-zero."""
    padded = -(-spec.vocab_size // (128 * TRAIN_TP)) * 128 * TRAIN_TP
    layout = ShardLayout(tp_size=gen_tp, tp_rank=rank, padded_vocab_size=padded)
    out = []
    for row in PARAM_MAPPINGS:
        if not is_active(row, spec) or (row.tied_hf and spec.tie_word_embeddings):
            continue
        for layer in range(spec.num_layers) if row.per_layer else [None]:
            tensors = [hf[n] for n in hf_names(row, spec, layer)]
            name = row.megatron[0].format(layer=layer)
            shard = hf_to_megatron_shard(row, tensors, spec, layout)
            if row.transform == "vocab":  # training moves the padding rows too: vLLM must get zeros there
                first_pad = max(0, spec.vocab_size - rank * shard.shape[0])
                shard[first_pad:] = 7.0
            out.append((name, shard))
    return out


def _expected(spec: ModelSpec, hf: dict, gen_tp: int, rank: int) -> dict[str, torch.Tensor]:
    full = dict(hf)
    if spec.tie_word_embeddings:
        full["lm_head.weight"] = hf["model.embed_tokens.weight"]
    out = hf_llama_to_vllm_shards(full, spec.num_layers, rank, gen_tp)
    if spec.tie_word_embeddings:
        del out["lm_head.weight"]  # vLLM's lm_head shares the embedding's parameter
    if spec.qkv_bias:
        for i in range(spec.num_layers):
            p = f"model.layers.{i}.self_attn."
            out[p + "qkv_proj.bias"] = torch.cat([b.chunk(gen_tp)[rank] for b in
                                                  (hf[p + f"{x}_proj.bias"] for x in "qkv")])
    return out


def _convert(spec, hf, gen_tp, rank, bucket_bytes):
    shards = {r: _megatron_generation_shards(spec, hf, gen_tp, r) for r in range(gen_tp)}
    vocab_names = {name for name, t in shards[rank] if name.endswith(("word_embeddings.weight", "output_layer.weight"))}

    def exchange_vocab(shard, vllm_rows):  # the point-to-point exchange over the generation TP group
        name = next(n for n in vocab_names if dict(shards[rank])[n].data_ptr() == shard.data_ptr())
        out = torch.zeros(vllm_rows, shard.shape[1])
        for src, dst, src_row, dst_row, count in vocab_row_transfers(gen_tp, shard.shape[0], vllm_rows,
                                                                     spec.vocab_size):
            if dst == rank:
                out[dst_row:dst_row + count] = dict(shards[src])[name][src_row:src_row + count]
        return out

    shapes = {k: tuple(v.shape) for k, v in _expected(spec, hf, gen_tp, rank).items()}
    return list(iter_vllm_buckets(iter(shards[rank]), spec, gen_tp=gen_tp, gen_tp_rank=rank, vllm_shapes=shapes,
                                  exchange_vocab=exchange_vocab, bucket_bytes=bucket_bytes))


def _alone(spec):
    """The vocabulary exchange at t_g = 1 (no group)."""
    return lambda shard, rows: exchange_vocab_rows(shard, rows, spec.vocab_size, None)


@pytest.mark.parametrize("vocab", [VOCAB, 250, 512], ids=["vocab_regathered", "vocab_tail_zeroed", "vocab_as_is"])
@pytest.mark.parametrize("qkv_bias", [False, True], ids=["llama", "qwen2"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("gen_tp", [1, 2], ids=["gen_tp1", "gen_tp2"])
def test_buckets_hold_exactly_vllms_local_shards(gen_tp, tied, qkv_bias, vocab):
    """Megatron pads to 256 rows (t = 2), vLLM to 64: 100 rows re-cut after the all-gather,
    250 the same rows on both sides (padding zeroed), 512 no padding at all."""
    spec = _spec(tied, qkv_bias, vocab)
    hf = _hf_state(spec)
    for rank in range(gen_tp):
        buckets = _convert(spec, hf, gen_tp, rank, bucket_bytes=1 << 30)
        assert len(buckets) == 1
        got = dict(buckets[0])
        assert len(got) == len(buckets[0])  # every vLLM parameter once
        expected = _expected(spec, hf, gen_tp, rank)
        assert sorted(got) == sorted(expected)
        for name, tensor in expected.items():
            assert torch.equal(got[name], tensor), (rank, name)


@pytest.mark.parametrize("gen_tp", [1, 2], ids=["gen_tp1", "gen_tp2"])
def test_buckets_respect_the_byte_limit_and_pack_greedily(gen_tp):
    spec = _spec(tied=False)
    hf = _hf_state(spec)
    whole = _convert(spec, hf, gen_tp, 0, bucket_bytes=1 << 30)[0]
    sizes = [t.numel() * t.element_size() for _, t in whole]
    limit = 3 * max(sizes) // 2  # some buckets hold one tensor, some several
    buckets = _convert(spec, hf, gen_tp, 0, bucket_bytes=limit)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in whole]  # same order, nothing lost
    totals = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets]
    assert all(total <= limit for total in totals)
    assert len(buckets) > 2
    for bucket, nxt in zip(buckets, buckets[1:]):  # a bucket closes only when the next tensor does not fit
        first = nxt[0][1]
        assert sum(t.numel() * t.element_size() for _, t in bucket) + first.numel() * first.element_size() > limit
    # a tensor larger than the limit forms a bucket of its own
    small = _convert(spec, hf, gen_tp, 0, bucket_bytes=min(sizes))
    assert [len(b) for b in small] == [1] * len(whole)


def test_buckets_are_built_lazily():
    spec = _spec(tied=False)
    hf = _hf_state(spec)
    shards = _megatron_generation_shards(spec, hf, 1, 0)
    pulled = []

    def source():
        for item in shards:
            pulled.append(item[0])
            yield item

    shapes = {k: tuple(v.shape) for k, v in _expected(spec, hf, 1, 0).items()}
    limit = max(t.numel() * t.element_size() for _, t in shards)
    buckets = iter_vllm_buckets(source(), spec, gen_tp=1, gen_tp_rank=0, vllm_shapes=shapes,
                                exchange_vocab=_alone(spec), bucket_bytes=limit)
    assert pulled == []
    first = next(buckets)
    assert len(pulled) == len(first) + 1  # the bucket, and the one tensor that did not fit any more
    assert len(pulled) < len(shards)


def test_bad_input_is_refused_naming_it():
    spec = _spec(tied=False)
    hf = _hf_state(spec)
    shards = _megatron_generation_shards(spec, hf, 1, 0)
    shapes = {k: tuple(v.shape) for k, v in _expected(spec, hf, 1, 0).items()}
    kwargs = dict(gen_tp=1, gen_tp_rank=0, exchange_vocab=_alone(spec))
    with pytest.raises(ValueError, match="bucket_bytes must be > 0, got 0"):
        next(iter_vllm_buckets(iter(shards), spec, vllm_shapes=shapes, bucket_bytes=0, **kwargs))
    with pytest.raises(KeyError, match="decoder.layers.0.mlp.nope.weight"):
        next(iter_vllm_buckets(iter([("decoder.layers.0.mlp.nope.weight", torch.zeros(2))]), spec,
                               vllm_shapes=shapes, bucket_bytes=1 << 20, **kwargs))
    wrong = dict(shapes, **{"model.layers.1.mlp.down_proj.weight": (16, 12)})
    with pytest.raises(ValueError, match=r"'decoder.layers.1.mlp.linear_fc2.weight' has shape \(16, 24\) but "
                                         r"vLLM's 'model.layers.1.mlp.down_proj.weight' expects \(16, 12\)"):
        list(iter_vllm_buckets(iter(shards), spec, vllm_shapes=wrong, bucket_bytes=1 << 20, **kwargs))


def test_names_follow_the_hf_table_and_vllms_packing():
    spec = _spec(tied=False, qkv_bias=True)
    assert vllm_param_name("decoder.layers.3.self_attention.linear_qkv.bias", spec) == \
        "model.layers.3.self_attn.qkv_proj.bias"
    assert vllm_param_name("decoder.layers.0.mlp.linear_fc1.weight", spec) == "model.layers.0.mlp.gate_up_proj.weight"
    assert vllm_param_name("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", spec) == \
        "model.layers.0.post_attention_layernorm.weight"
    assert vllm_param_name("output_layer.weight", spec) == "lm_head.weight"
    assert vllm_param_name("output_layer.weight", _spec(tied=True)) is None


def test_packed_modules_are_vllms_own():
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM

    for cls in (LlamaForCausalLM, Qwen2ForCausalLM):
        assert {k: tuple(v) for k, v in cls.packed_modules_mapping.items()} == dict(VLLM_PACKED_MODULES)


@pytest.mark.parametrize("value", [0, -4])
def test_a_bucket_size_below_one_mib_is_refused_at_load_naming_the_key(value):
    from megaflow.config import ConfigError
    from megaflow.topology import load_run

    with pytest.raises(ConfigError, match=rf"rollout.weight_sync_bucket_mb: must be > 0, got {value}"):
        load_run("tiny_arith_grpo", [f"rollout.weight_sync_bucket_mb={value}"])
    assert load_run("tiny_arith_grpo", ["rollout.weight_sync_bucket_mb=3"]).rollout.weight_sync_bucket_mb == 3


def _gather_on_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from megaflow.hybrid_engine.rollout_weights import gather_rows

    group = dist.new_group(list(range(world_size)))
    shard = torch.full((3, 2), float(rank)) + torch.arange(6.0).view(3, 2)
    return {"gathered": gather_rows(shard, group), "alone_is_itself": gather_rows(shard, None) is shard}


@pytest.mark.slow
def test_gather_rows_concatenates_the_ranks_shards_in_rank_order():
    from megaflow.utils.launch import run_distributed

    results = run_distributed(_gather_on_rank, 2)
    expected = torch.cat([torch.full((3, 2), float(r)) + torch.arange(6.0).view(3, 2) for r in range(2)])
    for res in results:
        assert torch.equal(res["gathered"], expected) and res["alone_is_itself"]


def test_vocab_row_transfers_move_only_the_real_rows_each_rank_lacks():
    # 2 ranks, Megatron 128 rows each (256 padded), vLLM 64 rows each (vocabulary 100, padded to 128)
    assert vocab_row_transfers(2, 128, 64, 100) == [(0, 0, 0, 0, 64), (0, 1, 64, 0, 36)]
    # Megatron 500 rows each, vLLM 512: rank 0 needs 12 rows of rank 1, rank 1 keeps its own
    assert vocab_row_transfers(2, 500, 512, 1000) == [(0, 0, 0, 0, 500), (1, 0, 0, 500, 12), (1, 1, 12, 0, 488)]
    # every real row goes exactly once, to the rank and row vLLM expects
    for size, m_rows, v_rows, vocab in ((2, 128, 64, 100), (4, 320, 300, 1190), (3, 64, 64, 150)):
        dest = [(dst * v_rows + dr + i) for src, dst, sr, dr, n in vocab_row_transfers(size, m_rows, v_rows, vocab)
                for i in range(n)]
        srcs = [(src * m_rows + sr + i) for src, dst, sr, dr, n in vocab_row_transfers(size, m_rows, v_rows, vocab)
                for i in range(n)]
        assert sorted(dest) == list(range(vocab)) and dest == srcs


def _exchange_on_rank(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    group = dist.new_group(list(range(world_size)))
    full = torch.arange(1000 * 3, dtype=torch.float32).view(1000, 3)  # Megatron: 500 rows per rank
    shard = full[rank * 500:(rank + 1) * 500].clone()
    return {"rows": exchange_vocab_rows(shard, 512, 1000, group)}


@pytest.mark.slow
def test_exchange_vocab_rows_gives_each_rank_vllms_rows_point_to_point():
    from megaflow.utils.launch import run_distributed

    results = run_distributed(_exchange_on_rank, 2)
    full = torch.arange(1000 * 3, dtype=torch.float32).view(1000, 3)
    padded = torch.cat([full, torch.zeros(24, 3)])  # vLLM: 1024 rows, 512 per rank, zero past 1000
    for rank, res in enumerate(results):
        assert torch.equal(res["rows"], padded[rank * 512:(rank + 1) * 512]), rank
