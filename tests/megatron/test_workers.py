"""Megatron workers through the controller: one colocated Ray group (actor + ref + critic +
reward model) on 4 ranks with tp=2 (dp=2), weights loaded from HF directories.

Checks: results come back in input order for a batch that does not divide dp (padding is
added and removed by the ND dispatch) and equal ``transformers`` on the same weights;
on-policy first update has ratio 1 (clip fraction 0, approx KL 0) and changes the policy;
the critic update reports its metrics; save/load restores the trained policy.
"""
from __future__ import annotations

import pytest
import torch

from megaflow.protocol import DataProto
from megatron_testlib import (hf_causal_lm, hf_reference, make_batch, tiny_llama_config)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    from transformers import LlamaForSequenceClassification

    cfg = tiny_llama_config()
    causal = hf_causal_lm(cfg, seed=3)
    root = tmp_path_factory.mktemp("hf")
    causal.save_pretrained(root / "causal")
    torch.manual_seed(4)
    scorer = LlamaForSequenceClassification(tiny_llama_config(num_labels=1)).float().eval()
    scorer.model.load_state_dict(causal.model.state_dict())
    scorer.save_pretrained(root / "score")
    return dict(causal_dir=str(root / "causal"), score_dir=str(root / "score"), causal=causal,
                scorer=scorer)


@pytest.fixture(scope="module")
def groups(ray_session, hf_dirs):
    from megaflow.topology.role_spec import RoleSpec
    from megaflow.single_controller import (ClassWithInitArgs, RayWorkerGroup, ResourcePool,
                                            create_colocated_worker_cls)
    from megaflow.workers.megatron_workers import (ActorWorker, CriticWorker, RefWorker,
                                                   RewardModelWorker)
    from role_testlib import seq_len_overrides, test_config

    # 4 ranks at tp=2: dp=2. 4 prompts x n=2 = 8 samples; the actor's mini-batches hold 2 prompts
    # (4 samples, 2 per DP rank), the critic's all 8 samples; micro-batches of 2 samples.
    parallel = [f"{role}.tp=2" for role in ("actor", "ref", "critic", "reward_model")]
    micro = ["actor.ppo_micro_batch_size_per_gpu=2", "actor.log_prob_micro_batch_size_per_gpu=2",
             "ref.log_prob_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size_per_gpu=2",
             "critic.forward_micro_batch_size_per_gpu=2", "reward_model.micro_batch_size_per_gpu=2"]
    offload = [f"{role}.{flag}=true" for role in ("actor", "critic")
               for flag in ("param_offload", "grad_offload", "optimizer_offload")]
    cfg = test_config([
        *parallel, *micro, *offload, *seq_len_overrides(32), "resources.procs_per_node=4", "rollout.n=2",
        "rollout.temperature=0.9", "data.train_batch_size=4", "actor.ppo_mini_batch_size=2",
        "critic.ppo_mini_batch_size=4", "actor.entropy_coeff=0.01", "actor.optim.lr=5e-3",
        "actor.optim.weight_decay=0.0", "actor.optim.lr_warmup_steps=0", "critic.optim.lr=5e-3",
        "critic.optim.weight_decay=0.0", "algorithm.adv_estimator=gae", "critic.enabled=true", "ref.enabled=true",
        "reward_model.enabled=true", "ref.param_offload=true", "reward_model.param_offload=true"],
        sections={"model": {"path": hf_dirs["causal_dir"], "hf_config": None},
                  "critic": {"path": hf_dirs["score_dir"]}, "reward_model": {"path": hf_dirs["score_dir"]}})
    spec = create_colocated_worker_cls({
        "actor": ClassWithInitArgs(ActorWorker, RoleSpec(cfg, "actor", 1)),
        "ref": ClassWithInitArgs(RefWorker, RoleSpec(cfg, "ref", 1)),
        "critic": ClassWithInitArgs(CriticWorker, RoleSpec(cfg, "critic", 1)),
        "rm": ClassWithInitArgs(RewardModelWorker, RoleSpec(cfg, "reward_model", 1)),
    })
    views = RayWorkerGroup(ResourcePool([4], num_cpus_per_process=0.5, name_prefix="mf_megatron"),
                           spec).spawn()
    for name in ("actor", "ref", "critic", "rm"):
        views[name].call("init_model")
    return views


def _proto(batch: dict, temperature: float = 0.9) -> DataProto:
    return DataProto.from_dict(tensors=batch, meta_info={"temperature": temperature})


def test_forward_roles_return_input_order_and_match_transformers(groups, hf_dirs):
    batch = make_batch(21, batch=7)  # 7 rows on dp=2: one padding row added and removed
    data = _proto(batch)
    resp_len = batch["responses"].shape[1]
    valid = batch["attention_mask"][:, -resp_len:].float()
    with torch.no_grad():
        ref = hf_reference(hf_dirs["causal"], batch, temperature=0.9)
        scorer = hf_dirs["scorer"]
        hidden = scorer.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                              position_ids=batch["position_ids"]).last_hidden_state
        per_token = (hidden @ scorer.score.weight.T).squeeze(-1)
    tol = dict(atol=1e-5, rtol=0)

    old = groups["actor"].call("compute_log_prob", data)
    assert len(old) == 7
    torch.testing.assert_close(old.batch["old_log_probs"], ref["log_probs"] * valid, **tol)
    torch.testing.assert_close(old.batch["entropys"], ref["entropy"] * valid, **tol)
    ref_lp = groups["ref"].call("compute_ref_log_prob", data)
    torch.testing.assert_close(ref_lp.batch["ref_log_probs"], ref["log_probs"] * valid, **tol)

    values = groups["critic"].call("compute_values", data).batch["values"]
    torch.testing.assert_close(values, per_token[:, -resp_len - 1:-1] * valid, **tol)
    scores = groups["rm"].call("compute_rm_score", data).batch["rm_scores"]
    last = batch["attention_mask"].cumsum(-1).argmax(-1)  # index of the last real token
    expected = torch.zeros_like(scores)
    for row in range(7):
        expected[row, last[row] - (batch["input_ids"].shape[1] - resp_len)] = per_token[row, last[row]]
    torch.testing.assert_close(scores, expected, **tol)


def _update_batch(groups):
    batch = make_batch(22, batch=8)
    data = _proto(batch)
    data = data.union(groups["actor"].call("compute_log_prob", data).select(batch_keys=["old_log_probs"]))
    adv = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(2))
    returns = torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(3))
    extra = DataProto.from_dict({"advantages": adv, "returns": returns})
    data = data.union(extra).union(groups["critic"].call("compute_values", data))
    return data


def test_updates_and_checkpoint_round_trip(groups, tmp_path):
    data = _update_batch(groups)
    before = data.batch["old_log_probs"].clone()
    per_rank = groups["actor"].call("update_actor", data)  # one dict per DP rank, DP-reduced by the engine
    assert len(per_rank) >= 1 and all(m == per_rank[0] for m in per_rank), per_rank
    metrics = per_rank[0]
    # two mini-batches of 4 rows: the first is on-policy (ratio 1), the second is not
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/lr"] == pytest.approx(5e-3)
    assert 0 <= metrics["actor/clip_fraction"] < 0.5
    assert set(metrics) >= {"actor/pg_loss", "actor/approx_kl", "actor/entropy"}
    critic = groups["critic"].call("update_critic", data)[0]
    assert critic["critic/vf_loss"] > 0 and critic["critic/grad_norm"] > 0

    trained = groups["actor"].call("compute_log_prob", data).batch["old_log_probs"]
    assert (trained - before).abs().max() > 1e-3  # the policy moved
    path = str(tmp_path / "actor_ckpt")
    groups["actor"].call("save_checkpoint", path)
    groups["actor"].call("update_actor", data)  # move away from the saved state ...
    moved = groups["actor"].call("compute_log_prob", data).batch["old_log_probs"]
    assert (moved - trained).abs().max() > 1e-4
    groups["actor"].call("load_checkpoint", path)  # ... and back
    restored = groups["actor"].call("compute_log_prob", data).batch["old_log_probs"]
    torch.testing.assert_close(restored, trained, atol=1e-6, rtol=0)
