"""Micro-DP resharding of a real megatron-core GPTModel (megaflow's builder, t=2, p=2).

The model is built by ``megaflow.megatron.model.build_gpt_model`` on 4 gloo ranks, its
parameters are overwritten with the synthetic reference weights of ``hybrid_synthetic``
(same names and shapes, so this also checks that the builder's names, megatron's
``partition_dim`` / ``partition_stride`` attributes and the local layer numbering are what
the resharder expects), then resharded to t_g = 2 and t_g = 1 and compared bit for bit
with the megatron TP = t_g shards of the full reference model.
"""
import pytest
import torch

from hybrid_synthetic import TinyConfig, full_components, generation_shard, training_shard
from megaflow.utils.launch import run_distributed

CFG = TinyConfig(vocab=256, layers_per_stage=(2, 2), tied=False, norms=True, qkv_bias=True)


def _qwen2_config():
    from transformers import Qwen2Config

    return Qwen2Config(hidden_size=CFG.hidden, intermediate_size=CFG.ffn,
                       num_hidden_layers=CFG.num_layers, num_attention_heads=CFG.heads,
                       num_key_value_heads=CFG.kv_heads, vocab_size=200,  # padded to 256
                       max_position_embeddings=32, tie_word_embeddings=False)


def _rank(rank: int, world_size: int) -> dict:
    from megaflow.hybrid_engine import MicroDPResharder, build_reshard_groups, plan_hybrid_layout
    from megaflow.megatron.model import build_gpt_model
    from megaflow.megatron.parallel import destroy_parallel, initialize_parallel

    info = initialize_parallel(tp=2, pp=2)
    model = build_gpt_model(_qwen2_config())
    params = dict(model.named_parameters())
    comps = full_components(CFG)
    reference = training_shard(CFG, comps, tp=2, tp_rank=info.tp_rank, pp_rank=info.pp_rank)
    out = {"names": sorted(params) == sorted(reference),
           "shapes": all(params[n].shape == reference[n].shape for n in reference if n in params)}
    with torch.no_grad():
        for name, tensor in reference.items():
            params[name].copy_(tensor)
    for gen_tp in (2, 1):
        layout = plan_hybrid_layout(2, 2, 1, gen_tp=gen_tp, num_attention_heads=CFG.heads,
                                    num_query_groups=CFG.kv_heads)
        me = layout.ranks[rank]
        resharder = MicroDPResharder(build_reshard_groups(layout), params)
        with resharder.generation() as stats:
            expected = generation_shard(CFG, comps, gen_tp=gen_tp, gen_tp_rank=me.gen_tp_rank,
                                        stages=range(2))
            got = dict(resharder.named_generation_tensors())
            out[gen_tp] = {"names": sorted(got) == sorted(expected),
                           "mismatch": [n for n in expected if n in got
                                        and not torch.equal(got[n], expected[n])],
                           "aliased": stats.num_aliased, "copied": stats.num_copied}
        params_now = dict(model.named_parameters())
        out[gen_tp]["restored"] = all(params_now[n] is params[n] and torch.equal(params[n], t)
                                      for n, t in reference.items())
    destroy_parallel()
    return out


@pytest.mark.slow
def test_real_gpt_model_t2_p2_to_tg2_and_tg1():
    results = run_distributed(_rank, 4, timeout_s=600)
    for rank, res in enumerate(results):
        assert res["names"] and res["shapes"], rank
        for gen_tp in (2, 1):
            r = res[gen_tp]
            assert r["names"] and r["mismatch"] == [] and r["restored"], (rank, gen_tp, r)
            assert r["copied"] == 0
        assert res[1]["aliased"] > 0 and res[2]["aliased"] == 0  # t_g = t moves nothing
