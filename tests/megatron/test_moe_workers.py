"""An MoE actor through the Ray worker group (megaflow.workers.megatron_workers): 2 ranks,
``actor.tp=1``, ``actor.ep=2`` (each rank builds and loads 2 of the 4 experts), with the
router losses on. The old log-probs equal ``transformers`` on the same weights; the update
reports the router losses; the checkpoint's layout.json records the EP size the workers'
parallel state was initialised with (so ``actor.ep`` reached ``initialize_parallel``).
"""
from __future__ import annotations

import json

import pytest
import torch

import moe_testlib
from megaflow.protocol import DataProto
from megatron_testlib import VOCAB, batch_with_advantages, hf_reference

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_actor(ray_session, tmp_path_factory):
    from megaflow.single_controller import ClassWithInitArgs, RayWorkerGroup, ResourcePool
    from megaflow.topology.role_spec import RoleSpec
    from megaflow.workers.megatron_workers import ActorWorker
    from role_testlib import seq_len_overrides, test_config

    hf = moe_testlib.tiny_moe_model(VOCAB)
    hf_dir = tmp_path_factory.mktemp("qwen3_moe")
    hf.save_pretrained(hf_dir)
    cfg = test_config(["resources.procs_per_node=2", "actor.tp=1", "actor.ep=2", "rollout.tp=1", *seq_len_overrides(32),
                       "rollout.n=2", "data.train_batch_size=3", "actor.ppo_mini_batch_size=3",
                       "actor.ppo_micro_batch_size_per_gpu=1", "actor.log_prob_micro_batch_size_per_gpu=2",
                       "actor.moe_aux_loss_coeff=0.01", "actor.moe_z_loss_coeff=0.001", "rollout.temperature=0.9"],
                      sections={"model": {"path": str(hf_dir), "hf_config": None}})
    group = RayWorkerGroup(ResourcePool([2], num_cpus_per_process=0.5, name_prefix="mf_moe"),
                           ClassWithInitArgs(ActorWorker, RoleSpec(cfg, "actor", 1)), name_prefix="actor")
    group.call("init_model")
    return group, hf


def test_expert_parallel_actor_matches_transformers_and_records_its_ep(moe_actor, tmp_path):
    group, hf = moe_actor
    batch = batch_with_advantages()
    data = DataProto.from_dict(tensors=batch, meta_info={"temperature": 0.9})
    valid = batch["response_mask"].float()
    with torch.no_grad():
        ref = hf_reference(hf, batch, temperature=0.9)
    old = group.call("compute_log_prob", data)
    torch.testing.assert_close(old.batch["old_log_probs"], ref["log_probs"] * valid, atol=1e-5, rtol=0)
    data.batch["old_log_probs"] = old.batch["old_log_probs"]
    metrics = group.call("update_actor", data)
    metrics = metrics[0] if isinstance(metrics, list) else metrics
    assert metrics["actor/moe_aux_loss"] > 0 and metrics["actor/moe_z_loss"] > 0
    group.call("save_checkpoint", str(tmp_path / "ckpt"))
    assert json.loads((tmp_path / "ckpt" / "layout.json").read_text())["ep"] == 2
