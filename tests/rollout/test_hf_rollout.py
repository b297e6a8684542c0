"""The transformers reference rollout against slow, independent references (in-process)."""
from __future__ import annotations

import pytest
import torch

from megaflow.rollout.hf_rollout import HFRollout
from megaflow.rollout.sampling import SamplingConfig
from rollout_testlib import first_eos_mask, left_padded_prompts, teacher_forced_log_probs, top_k_log_probs, with_meta

RESPONSE_LEN = 8


@pytest.fixture(scope="module")
def prompts():
    return left_padded_prompts([3, 6, 1], width=6, seed=1)


@pytest.fixture(scope="module")
def hf_rollout(hf_tiny_llama):
    return HFRollout(hf_tiny_llama, SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))


@torch.no_grad()
def greedy_loop(model, tokens: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding without KV cache: argmax of the last position, one token at a time."""
    out, log_probs = list(tokens), []
    for _ in range(steps):
        logits = model(torch.tensor([out])).logits[0, -1].float()
        token = int(logits.argmax())
        log_probs.append(float(torch.log_softmax(logits, -1)[token]))
        out.append(token)
    return out[len(tokens):], log_probs


def test_greedy_equals_uncached_greedy_loop(hf_rollout, hf_tiny_llama, prompts, monkeypatch):
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    loops = [greedy_loop(hf_tiny_llama, ids[b][mask[b].bool()].tolist(), RESPONSE_LEN) for b in range(len(prompts))]
    # The model's own default EOS must not stop a rollout configured without EOS ids.
    monkeypatch.setattr(hf_tiny_llama.generation_config, "eos_token_id", loops[0][0][2])
    out = hf_rollout.generate_sequences(with_meta(prompts, do_sample=False))
    for b, (tokens, log_probs) in enumerate(loops):
        assert out.batch["responses"][b].tolist() == tokens
        torch.testing.assert_close(out.batch["rollout_log_probs"][b], torch.tensor(log_probs), atol=1e-4, rtol=0)
    assert out.batch["response_mask"].eq(1).all()
    assert torch.equal(out.batch["input_ids"], torch.cat([ids, out.batch["responses"]], dim=1))
    assert list(out.non_tensor_batch["uid"]) == list(prompts.non_tensor_batch["uid"])


def test_pad_equal_to_eos_keeps_the_first_eos_only(hf_rollout, prompts):
    free = hf_rollout.generate_sequences(with_meta(prompts, do_sample=False)).batch["responses"]
    eos = int(free[0, 2])  # a token the model emits mid-response: make it the EOS (and the pad)
    out = hf_rollout.generate_sequences(with_meta(prompts, do_sample=False, eos_token_id=eos, pad_token_id=eos))
    responses, mask = out.batch["responses"], out.batch["response_mask"]
    assert torch.equal(mask, first_eos_mask(responses, eos))
    assert mask[0].sum() <= 3 and responses[0, int(mask[0].sum()) - 1] == eos
    assert torch.equal(responses[mask == 0], torch.full_like(responses[mask == 0], eos))
    assert torch.equal(out.batch["attention_mask"][:, -RESPONSE_LEN:], mask)


def test_sampled_log_probs_are_temperature_scaled_and_seed_reproducible(hf_rollout, hf_tiny_llama, prompts):
    meta = dict(n=3, temperature=0.7, seed=5)
    out = hf_rollout.generate_sequences(with_meta(prompts, **meta))
    again = hf_rollout.generate_sequences(with_meta(prompts, **meta))
    other = hf_rollout.generate_sequences(with_meta(prompts, **{**meta, "seed": 6}))
    assert out.batch["responses"].shape == (3 * len(prompts), RESPONSE_LEN)
    assert torch.equal(out.batch["responses"], again.batch["responses"])
    assert not torch.equal(out.batch["responses"], other.batch["responses"])
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(3, dim=0))
    reference = teacher_forced_log_probs(hf_tiny_llama, out, temperature=0.7)
    torch.testing.assert_close(out.batch["rollout_log_probs"], reference, atol=1e-4, rtol=0)


def test_top_k_log_probs_are_renormalised_over_the_kept_tokens(hf_rollout, hf_tiny_llama, prompts):
    out = hf_rollout.generate_sequences(with_meta(prompts, n=2, temperature=0.9, top_k=5, seed=3))
    reference = top_k_log_probs(hf_tiny_llama, out, temperature=0.9, top_k=5)
    torch.testing.assert_close(out.batch["rollout_log_probs"], reference, atol=1e-4, rtol=0)


def test_errors_name_the_problem(hf_rollout, prompts):
    right_padded = with_meta(prompts)
    right_padded.batch["attention_mask"] = prompts.batch["attention_mask"].flip(-1)
    with pytest.raises(ValueError, match="left-padded"):
        hf_rollout.generate_sequences(right_padded)
    with pytest.raises(ValueError, match="'top_p'"):
        hf_rollout.generate_sequences(with_meta(prompts, top_p=1.5))
    with pytest.raises(ValueError, match="attention_mask"):
        hf_rollout.generate_sequences(prompts.select(batch_keys=["input_ids"]))
