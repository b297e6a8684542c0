"""Plain-tensor parts of the rollout engines: sampling config, seeds, prompt/output plumbing,
TP-group validation. No model, no processes."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.rollout.batch import (assemble_rollout_batch, check_left_padded, position_ids_for_rollout,
                                   prompt_token_lists, rollout_output)
from megaflow.rollout.sampling import SamplingConfig, request_seeds
from megaflow.rollout.vllm_groups import consecutive_tp_groups, validate_tp_groups


# ---------------------------------------------------------------------------- sampling config
def test_sampling_override_reads_meta_info_and_ignores_other_keys():
    base = SamplingConfig(eos_token_ids=(2,), pad_token_id=2, response_length=16)
    cfg = base.override({"n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 8,
                         "eos_token_id": [7, 9], "seed": 3, "global_step": 11})
    assert (cfg.n, cfg.temperature, cfg.top_p, cfg.top_k) == (4, 0.7, 0.9, 5)
    assert (cfg.response_length, cfg.eos_token_ids, cfg.seed, cfg.pad_token_id) == (8, (7, 9), 3, 2)
    assert not cfg.greedy
    assert base.override({"do_sample": False}).greedy
    assert base.override({"temperature": 0.0}).greedy
    assert base.override({}) is base


@pytest.mark.parametrize("meta, match", [
    ({"n": 0}, "'n'"), ({"temperature": -1.0}, "'temperature'"), ({"top_p": 0.0}, "'top_p'"),
    ({"top_k": -2}, "'top_k'"), ({"response_length": 0}, "'response_length'"),
    ({"response_length": 8, "max_tokens": 9}, "max_tokens"), ({"pad_token_id": -1}, "'pad_token_id'"),
])
def test_sampling_override_rejects_bad_values(meta, match):
    with pytest.raises(ValueError, match=match):
        SamplingConfig().override(meta)


@pytest.mark.parametrize("meta, match", [({"n": 2.0}, "'n'"), ({"do_sample": 1}, "'do_sample'"),
                                         ({"eos_token_id": "2"}, "'eos_token_id'"), ({"seed": "x"}, "'seed'")])
def test_sampling_override_rejects_bad_types(meta, match):
    with pytest.raises(TypeError, match=match):
        SamplingConfig().override(meta)


def test_sampling_from_pretrained_prefers_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2, "pad_token_id": None}))
    assert SamplingConfig.from_pretrained(str(tmp_path)) == SamplingConfig(eos_token_ids=(2,), pad_token_id=2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6], "pad_token_id": 0}))
    cfg = SamplingConfig.from_pretrained(str(tmp_path), response_length=9)
    assert (cfg.eos_token_ids, cfg.pad_token_id, cfg.response_length) == ((5, 6), 0, 9)
    with pytest.raises(FileNotFoundError, match="config.json"):
        SamplingConfig.from_pretrained(str(tmp_path / "missing"))


def test_request_seeds_are_deterministic_distinct_and_stream_dependent():
    a = request_seeds(7, 64)
    assert a == request_seeds(7, 64)
    assert len(set(a)) == 64 and all(0 <= s < 2**63 for s in a)
    assert request_seeds(7, 8) == a[:8]  # a prefix does not depend on the count
    assert request_seeds(8, 64) != a and request_seeds(7, 64, stream=1) != a


# ---------------------------------------------------------------------------- prompts in
def test_prompt_token_lists_strips_left_padding():
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10], [0, 0, 0, 11]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    assert prompt_token_lists(ids, mask) == [[5, 6], [7, 8, 9, 10], [11]]
    assert check_left_padded(ids, mask).tolist() == [2, 4, 1]


@pytest.mark.parametrize("mask, match", [
    ([[1, 1, 0, 0]], "not left-padded"), ([[0, 1, 0, 1]], "not left-padded"), ([[0, 0, 0, 0]], "no real token"),
])
def test_prompt_token_lists_rejects_bad_masks(mask, match):
    with pytest.raises(ValueError, match=match):
        prompt_token_lists(torch.ones(1, 4, dtype=torch.long), torch.tensor(mask))


def test_prompt_token_lists_rejects_shape_and_dtype_errors():
    with pytest.raises(ValueError, match="attention_mask"):
        prompt_token_lists(torch.ones(2, 4, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(TypeError, match="input_ids"):
        prompt_token_lists(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.long))


# ---------------------------------------------------------------------------- outputs
def test_assemble_rollout_batch_matches_hand_built_fields():
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    # n = 2: rows (p0 s0, p0 s1, p1 s0, p1 s1); pad id 2 also appears as a real (EOS) token.
    responses = [[11, 2], [12, 13, 14], [2], []]
    log_probs = [[-0.5, -0.25], [-1.0, -2.0, -3.0], [-0.125], []]
    out = assemble_rollout_batch(prompt_ids, prompt_mask, responses, log_probs, n=2, response_length=3,
                                 pad_token_id=2)
    assert out["prompts"].tolist() == [[0, 5, 6], [0, 5, 6], [7, 8, 9], [7, 8, 9]]
    assert out["responses"].tolist() == [[11, 2, 2], [12, 13, 14], [2, 2, 2], [2, 2, 2]]
    assert out["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [0, 0, 0]]
    assert out["input_ids"].tolist()[1] == [0, 5, 6, 12, 13, 14]
    assert out["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1],
                                              [1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0]]
    assert out["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 4],
                                            [0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5]]
    assert out["rollout_log_probs"].tolist() == [[-0.5, -0.25, 0.0], [-1.0, -2.0, -3.0],
                                                 [-0.125, 0.0, 0.0], [0.0, 0.0, 0.0]]
    assert out["rollout_log_probs"].dtype == torch.float32 and out["responses"].dtype == torch.long


def test_assemble_rollout_batch_rejects_inconsistent_inputs():
    p, m = torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="batch \\* n"):
        assemble_rollout_batch(p, m, [[1]], None, n=2, response_length=4, pad_token_id=0)
    with pytest.raises(ValueError, match="more than response_length"):
        assemble_rollout_batch(p, m, [[1, 2, 3]], None, n=1, response_length=2, pad_token_id=0)
    with pytest.raises(ValueError, match="log-probs"):
        assemble_rollout_batch(p, m, [[1, 2]], [[-1.0]], n=1, response_length=2, pad_token_id=0)


def test_position_ids_continue_after_the_prompt():
    pos = position_ids_for_rollout(torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]]), 3)
    assert pos.tolist() == [[0, 0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5, 6]]


def test_rollout_output_repeats_non_tensors_interleaved_and_keeps_the_prompts_meta():
    prompts = DataProto.from_dict({"input_ids": torch.zeros(2, 1, dtype=torch.long)},
                                  {"uid": ["a", "b"]}, {"temperature": 1.0})
    out = rollout_output(prompts, {"responses": torch.zeros(6, 2, dtype=torch.long)}, 3)
    assert list(out.non_tensor_batch["uid"]) == ["a", "a", "a", "b", "b", "b"]
    assert out.meta_info == {"temperature": 1.0} and out.meta_info is not prompts.meta_info
    assert isinstance(out.non_tensor_batch["uid"], np.ndarray)


# ---------------------------------------------------------------------------- TP groups
def test_consecutive_tp_groups_are_vllms_default():
    assert consecutive_tp_groups(8, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="multiple"):
        consecutive_tp_groups(6, 4)


def test_validate_tp_groups_accepts_strided_hybridflow_groups():
    # t=4, t_g=2 on 8 ranks (2 training replicas): generation TP groups at stride t/t_g = 2.
    assert validate_tp_groups(((0, 2), (1, 3), (4, 6), (5, 7)), 8, 2) == [[0, 2], [1, 3], [4, 6], [5, 7]]


@pytest.mark.parametrize("groups, match", [
    ([[0, 1], [2]], "expected tp_size"), ([[2, 0], [1, 3]], "ascending"), ([[0, 1], [1, 2]], "partition"),
    ([[0, 1], [2, 4]], "partition"),
])
def test_validate_tp_groups_rejects_unusable_groups(groups, match):
    with pytest.raises(ValueError, match=match):
        validate_tp_groups(groups, 4, 2)
