"""vLLM rollout engine (TP = 1) against transformers on the same weights.

One engine is started once, in a spawned 1-rank gloo world (the production
``external_launcher`` path), runs every scenario and returns the outputs; the tests then
compare them here with ``transformers`` references (greedy decoding, teacher-forced
log-probs, the model with the synced weights).
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from megaflow.rollout.hf_rollout import HFRollout
from megaflow.rollout.sampling import SamplingConfig
from megaflow.utils.launch import run_distributed
from rollout_testlib import (MAX_MODEL_LEN, TINY_LLAMA, first_eos_mask, hf_llama_to_vllm_shards, left_padded_prompts,
                             load_hf, perturbed_state_dict, teacher_forced_log_probs, top_k_log_probs,
                             with_meta)

pytestmark = pytest.mark.slow

RESPONSE_LEN = 12
SAMPLE = dict(n=3, temperature=0.7, seed=11)
TOP_K = dict(n=2, temperature=0.9, top_k=5, seed=3)
OUTPUT_KEYS = {"prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask",
               "rollout_log_probs"}


def _error(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects type and message
        return type(exc).__name__, str(exc)
    return "no error", ""


def _engine_checks(rank, world_size, model_dir, prompts, eos, full_path, sharded_path):
    """Runs on the spawned rank: every scenario on one engine, outputs returned."""
    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    engine = VLLMRollout(VLLMRolloutConfig(model_dir, kv_cache_bytes=64 << 20, max_model_len=MAX_MODEL_LEN,
                                           max_num_seqs=32),
                         SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))
    greedy = with_meta(prompts, do_sample=False)
    res = {"version0": engine.weight_version, "shapes": engine.sharded_param_shapes(),
           "greedy": engine.generate_sequences(greedy),
           "greedy_eos": engine.generate_sequences(with_meta(prompts, do_sample=False, eos_token_id=eos,
                                                             pad_token_id=eos)),
           "sample": engine.generate_sequences(with_meta(prompts, **SAMPLE)),
           "sample_again": engine.generate_sequences(with_meta(prompts, **SAMPLE)),
           "sample_seed12": engine.generate_sequences(with_meta(prompts, **{**SAMPLE, "seed": 12})),
           "top_k": engine.generate_sequences(with_meta(prompts, **TOP_K)),
           "unseeded": [engine.generate_sequences(with_meta(prompts, n=2)) for _ in range(2)]}
    torch.manual_seed(5)
    engine.generate_sequences(with_meta(prompts, n=2))
    res["rng_after"] = torch.rand(4)
    torch.manual_seed(5)
    res["rng_expected"] = torch.rand(4)

    right_padded = with_meta(prompts)
    right_padded.batch["attention_mask"] = prompts.batch["attention_mask"].flip(-1)
    res["errors"] = {
        "right_padded": _error(lambda: engine.generate_sequences(right_padded)),
        "too_long": _error(lambda: engine.generate_sequences(with_meta(prompts, response_length=MAX_MODEL_LEN))),
        "bad_format": _error(lambda: engine.update_weights([], format="megatron")),
        "bad_shape": _error(lambda: engine.update_weights([("model.norm.weight", torch.ones(3))], format="sharded")),
        "bad_name": _error(lambda: engine.update_weights([("model.nope.weight", torch.ones(3))], format="sharded")),
        # a streamed update that leaves parameters unwritten is refused, and so is generating after it
        "incomplete": _error(lambda: engine.update_weights(
            [("model.norm.weight", torch.ones(TINY_LLAMA["hidden_size"]))], format="sharded")),
        "generate_after_incomplete": _error(lambda: engine.generate_sequences(greedy)),
        "bucket_without_update": _error(lambda: engine.load_weight_bucket([])),
    }
    res["version_after_errors"] = engine.weight_version
    from torch._dynamo.utils import counters

    res["compiled_frames"] = sum(counters["frames"].values())

    res["version1"] = engine.update_weights(torch.load(full_path).items(), format="hf_full")
    res["greedy_hf_full"] = engine.generate_sequences(greedy)
    shards = hf_llama_to_vllm_shards(torch.load(sharded_path), TINY_LLAMA["num_hidden_layers"], 0, 1)
    res["version2"] = engine.update_weights(shards.items(), format="sharded")
    res["greedy_sharded"] = engine.generate_sequences(greedy)
    res["sample_sharded"] = engine.generate_sequences(with_meta(prompts, **SAMPLE))
    # Back to the original weights through the full-tensor reload after the sharded update
    # replaced the parameters.
    from safetensors.torch import load_file

    res["version3"] = engine.update_weights(load_file(f"{model_dir}/model.safetensors").items())
    res["greedy_restored"] = engine.generate_sequences(greedy)
    return res


@pytest.fixture(scope="module")
def prompts():
    return left_padded_prompts([5, 12, 1, 8], width=12, seed=2)


@pytest.fixture(scope="module")
def hf_rollout(hf_tiny_llama):
    return HFRollout(hf_tiny_llama, SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))


@pytest.fixture(scope="module")
def eos(hf_rollout, prompts):
    """A token the model emits mid-response (greedy, row 0): used as EOS and pad id."""
    return int(hf_rollout.generate_sequences(with_meta(prompts, do_sample=False)).batch["responses"][0, 3])


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir, eos, tmp_path_factory):
    """The tiny model whose generation_config.json names ``eos``: a rollout configured without
    EOS ids must still run past it (vLLM adds the model's EOS ids unless told not to)."""
    path = tmp_path_factory.mktemp("tiny_llama_eos") / "model"
    shutil.copytree(tiny_llama_dir, path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "pad_token_id": 2}))
    return str(path)


@pytest.fixture(scope="module")
def new_weights(hf_tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    weights = {"hf_full": perturbed_state_dict(hf_tiny_llama, seed=1),
               "sharded": perturbed_state_dict(hf_tiny_llama, seed=2)}
    paths = {k: str(root / f"{k}.pt") for k in weights}
    for k, sd in weights.items():
        torch.save(sd, paths[k])
    return weights, paths


@pytest.fixture(scope="module")
def run(model_dir, prompts, eos, new_weights):
    _, paths = new_weights
    return run_distributed(_engine_checks, 1, model_dir, prompts, eos, paths["hf_full"], paths["sharded"],
                           timeout_s=900)[0]


def _assert_log_probs_match(out, model, temperature: float):
    reference = teacher_forced_log_probs(model, out, temperature) * out.batch["response_mask"]
    torch.testing.assert_close(out.batch["rollout_log_probs"], reference, atol=1e-4, rtol=0)
    # Sensitivity: the same comparison one position off misses by more than a nat.
    shifted = reference[:, 1:] - out.batch["rollout_log_probs"][:, :-1]
    assert (shifted * out.batch["response_mask"][:, 1:]).abs().max() > 1.0


def test_greedy_tokens_and_log_probs_equal_transformers(run, hf_rollout, hf_tiny_llama, prompts):
    out, reference = run["greedy"], hf_rollout.generate_sequences(with_meta(prompts, do_sample=False))
    assert set(out.batch.keys()) == OUTPUT_KEYS
    assert torch.equal(out.batch["responses"], reference.batch["responses"])
    assert out.batch["response_mask"].eq(1).all()  # ran past the model's own EOS (row 0, position 3)
    for key in OUTPUT_KEYS - {"rollout_log_probs"}:
        assert torch.equal(out.batch[key], reference.batch[key]), key
    _assert_log_probs_match(out, hf_tiny_llama, temperature=1.0)
    assert list(out.non_tensor_batch["uid"]) == list(prompts.non_tensor_batch["uid"])
    assert out.meta_info["do_sample"] is False


def test_sampled_log_probs_are_log_softmax_of_logits_over_temperature(run, hf_tiny_llama, prompts):
    out = run["sample"]
    assert out.batch["responses"].shape == (3 * len(prompts), RESPONSE_LEN)
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"].repeat_interleave(3, dim=0))
    assert list(out.non_tensor_batch["uid"]) == [u for u in prompts.non_tensor_batch["uid"] for _ in range(3)]
    _assert_log_probs_match(out, hf_tiny_llama, temperature=SAMPLE["temperature"])


def test_top_k_log_probs_are_of_the_truncated_distribution(run, hf_tiny_llama):
    """processed_logprobs with top-k on: renormalised over the k kept tokens (documented)."""
    out = run["top_k"]
    reference = top_k_log_probs(hf_tiny_llama, out, TOP_K["temperature"], TOP_K["top_k"])
    torch.testing.assert_close(out.batch["rollout_log_probs"], reference, atol=1e-4, rtol=0)
    untruncated = teacher_forced_log_probs(hf_tiny_llama, out, TOP_K["temperature"])
    gap = out.batch["rollout_log_probs"] - untruncated  # = -log(kept probability mass) >= 0
    assert gap.min() > -1e-5 and gap.max() > 1e-2


def test_response_mask_with_pad_equal_to_eos(run, hf_rollout, prompts, eos):
    out = run["greedy_eos"]
    reference = hf_rollout.generate_sequences(with_meta(prompts, do_sample=False, eos_token_id=eos, pad_token_id=eos))
    responses, mask = out.batch["responses"], out.batch["response_mask"]
    assert torch.equal(responses, reference.batch["responses"])
    assert torch.equal(mask, first_eos_mask(responses, eos))
    assert int(mask[0].sum()) <= 4 and responses[0, int(mask[0].sum()) - 1] == eos  # stopped at the EOS, kept it
    assert torch.equal(responses[mask == 0], torch.full_like(responses[mask == 0], eos))
    assert torch.equal(out.batch["attention_mask"][:, -RESPONSE_LEN:], mask)
    assert (out.batch["rollout_log_probs"][mask == 0] == 0).all()


def test_seeded_sampling_is_reproducible_and_unseeded_calls_differ(run):
    sample = run["sample"].batch["responses"]
    assert torch.equal(sample, run["sample_again"].batch["responses"])
    assert torch.equal(run["sample"].batch["rollout_log_probs"], run["sample_again"].batch["rollout_log_probs"])
    assert not torch.equal(sample, run["sample_seed12"].batch["responses"])
    first, second = (o.batch["responses"] for o in run["unseeded"])
    assert not torch.equal(first, second)
    groups = sample.view(-1, 3, RESPONSE_LEN)
    assert any(not torch.equal(g[0], g[1]) for g in groups)  # the n samples of a prompt differ


def test_generation_restores_the_global_rng(run):
    assert torch.equal(run["rng_after"], run["rng_expected"])


def test_errors_are_clear_and_do_not_bump_the_version(run):
    errors = run["errors"]
    assert errors["right_padded"][0] == "ValueError" and "left-padded" in errors["right_padded"][1]
    assert errors["too_long"][0] == "ValueError" and "max_model_len" in errors["too_long"][1]
    assert errors["bad_format"][0] == "ValueError" and "megatron" in errors["bad_format"][1]
    assert errors["bad_shape"][0] == "ValueError" and "model.norm.weight" in errors["bad_shape"][1]
    assert errors["bad_name"][0] == "KeyError" and "model.nope.weight" in errors["bad_name"][1]
    num_params = len(run["shapes"])
    unwritten = sorted(set(run["shapes"]) - {"model.norm.weight"})[:4]
    assert errors["incomplete"] == ("ValueError", f"weight update incomplete: no bucket wrote {num_params - 1} vLLM "
                                                  f"parameters, e.g. {unwritten}")
    assert errors["generate_after_incomplete"] == (
        "RuntimeError", f"the engine cannot generate: the last weight update left {num_params - 1} parameters "
                        "unwritten; load a complete weight update first")
    assert errors["bucket_without_update"] == ("RuntimeError", "load_weight_bucket: call begin_weight_update first")
    assert run["version0"] == 0 and run["version_after_errors"] == 0


def test_sharded_param_shapes_match_the_reference_layout(run, hf_tiny_llama):
    reference = hf_llama_to_vllm_shards(hf_tiny_llama.state_dict(), TINY_LLAMA["num_hidden_layers"], 0, 1)
    assert run["shapes"] == {k: tuple(v.shape) for k, v in reference.items()}


@pytest.mark.parametrize("route, version", [("hf_full", 1), ("sharded", 2)])
def test_update_weights_gives_transformers_output_of_the_new_weights(run, route, version, tiny_llama_dir,
                                                                     new_weights, prompts):
    weights, _ = new_weights
    new_model = load_hf(tiny_llama_dir, weights[route])
    reference = HFRollout(new_model, SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))
    out = run[f"greedy_{route}"]
    assert run[f"version{version}"] == version
    assert torch.equal(out.batch["responses"], reference.generate_sequences(
        with_meta(prompts, do_sample=False)).batch["responses"])
    assert not torch.equal(out.batch["responses"], run["greedy"].batch["responses"])
    _assert_log_probs_match(out, new_model, temperature=1.0)
    if route == "sharded":
        _assert_log_probs_match(run["sample_sharded"], new_model, temperature=SAMPLE["temperature"])


def test_routes_can_alternate(run):
    assert run["version3"] == 3
    assert torch.equal(run["greedy_restored"].batch["responses"], run["greedy"].batch["responses"])
    torch.testing.assert_close(run["greedy_restored"].batch["rollout_log_probs"],
                               run["greedy"].batch["rollout_log_probs"], atol=1e-5, rtol=0)


def test_cpu_engine_compiles_nothing(run):
    """On CPU the engine runs eagerly: vLLM's sampler would otherwise compile a helper with
    inductor on the first generate (seconds of the first step); dynamo saw no frame."""
    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    assert run["compiled_frames"] == 0
