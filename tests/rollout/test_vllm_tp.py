"""Tensor-parallel vLLM rollouts (SPMD, external launcher) inside a gloo world.

* 2 ranks, TP = 2, vLLM's own consecutive group; weight sync through full HF tensors.
* 4 ranks, TP = 2 with HybridFlow's strided generation groups [[0, 2], [1, 3]] (the
  layout of t = 4 -> t_g = 2): two replicas with different prompts, and a weight sync
  through already-sharded tensors where each rank loads the shard of its *generation*
  TP rank. Had vLLM grouped the ranks consecutively, ranks would hold mismatched shards.

The references are single-rank: ``transformers`` greedy decoding and teacher-forced
log-probs on the same weights (the TP = 1 engine equals them, test_vllm_rollout.py).
"""
from __future__ import annotations

import pytest
import torch

from megaflow.rollout.hf_rollout import HFRollout
from megaflow.rollout.sampling import SamplingConfig
from megaflow.utils.launch import run_distributed
from rollout_testlib import (MAX_MODEL_LEN, TINY_LLAMA, hf_llama_to_vllm_shards, left_padded_prompts, load_hf,
                             perturbed_state_dict, teacher_forced_log_probs, with_meta)

pytestmark = pytest.mark.slow

RESPONSE_LEN = 10
SAMPLE = dict(n=2, temperature=0.8, seed=21)


def _tp_rank_checks(rank, world_size, model_dir, prompts_per_replica, tp_group_ranks, weights_path, route):
    """On every rank: build the TP = 2 engine, generate, sync new weights, generate again."""
    from vllm.distributed.parallel_state import get_tp_group

    from megaflow.rollout.vllm_rollout import VLLMRollout, VLLMRolloutConfig

    engine = VLLMRollout(VLLMRolloutConfig(model_dir, tp_size=2, tp_group_ranks=tp_group_ranks,
                                           kv_cache_bytes=32 << 20, max_model_len=MAX_MODEL_LEN, max_num_seqs=16),
                         SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))
    group = engine.tp_group
    replica = 0 if tp_group_ranks is None else [list(g) for g in tp_group_ranks].index(group)
    prompts = prompts_per_replica[replica]
    res = {"group": group, "vllm_group": list(get_tp_group().ranks), "tp_rank": get_tp_group().rank_in_group,
           "greedy": engine.generate_sequences(with_meta(prompts, do_sample=False)),
           "sample": engine.generate_sequences(with_meta(prompts, **SAMPLE))}
    new_weights = torch.load(weights_path)
    if route == "sharded":
        new_weights = hf_llama_to_vllm_shards(new_weights, TINY_LLAMA["num_hidden_layers"], group.index(rank), 2)
    res["version"] = engine.update_weights(new_weights.items(), format=route)
    res["greedy_new"] = engine.generate_sequences(with_meta(prompts, do_sample=False))
    return res


@pytest.fixture(scope="module")
def new_weights(hf_tiny_llama, tiny_llama_dir, tmp_path_factory):
    state_dict = perturbed_state_dict(hf_tiny_llama, seed=3)
    path = str(tmp_path_factory.mktemp("tp_weights") / "new.pt")
    torch.save(state_dict, path)
    return load_hf(tiny_llama_dir, state_dict), path


def _reference(model):
    return HFRollout(model, SamplingConfig(eos_token_ids=(), pad_token_id=2, response_length=RESPONSE_LEN))


def _check_replica(results, prompts, old_model, new_model):
    """Both ranks of a replica agree exactly and match the single-rank references."""
    first, second = results
    for key in ("greedy", "sample", "greedy_new"):
        for field in ("responses", "rollout_log_probs", "response_mask"):
            assert torch.equal(first[key].batch[field], second[key].batch[field]), (key, field)
    greedy_old = _reference(old_model).generate_sequences(with_meta(prompts, do_sample=False)).batch["responses"]
    greedy_new = _reference(new_model).generate_sequences(with_meta(prompts, do_sample=False)).batch["responses"]
    assert torch.equal(first["greedy"].batch["responses"], greedy_old)
    assert torch.equal(first["greedy_new"].batch["responses"], greedy_new)
    assert not torch.equal(greedy_old, greedy_new)
    for key, model, temperature in (("greedy", old_model, 1.0), ("sample", old_model, SAMPLE["temperature"]),
                                    ("greedy_new", new_model, 1.0)):
        out = first[key]
        reference = teacher_forced_log_probs(model, out, temperature) * out.batch["response_mask"]
        torch.testing.assert_close(out.batch["rollout_log_probs"], reference, atol=1e-4, rtol=0)
    assert first["version"] == second["version"] == 1


def test_tp2_on_two_ranks_equals_single_rank(tiny_llama_dir, hf_tiny_llama, new_weights):
    new_model, path = new_weights
    prompts = left_padded_prompts([4, 9, 2], width=9, seed=4)
    results = run_distributed(_tp_rank_checks, 2, tiny_llama_dir, [prompts], None, path, "hf_full",
                              timeout_s=900)
    assert [r["vllm_group"] for r in results] == [[0, 1], [0, 1]]
    assert [r["tp_rank"] for r in results] == [0, 1]
    _check_replica(results, prompts, hf_tiny_llama, new_model)


def test_strided_generation_groups_on_four_ranks(tiny_llama_dir, hf_tiny_llama, new_weights):
    new_model, path = new_weights
    prompts = [left_padded_prompts([6, 3], width=6, seed=5), left_padded_prompts([2, 7, 5], width=7, seed=6)]
    groups = ((0, 2), (1, 3))
    results = run_distributed(_tp_rank_checks, 4, tiny_llama_dir, prompts, groups, path, "sharded",
                              timeout_s=900)
    assert [r["vllm_group"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["tp_rank"] for r in results] == [0, 0, 1, 1]
    _check_replica([results[0], results[2]], prompts[0], hf_tiny_llama, new_model)
    _check_replica([results[1], results[3]], prompts[1], hf_tiny_llama, new_model)
