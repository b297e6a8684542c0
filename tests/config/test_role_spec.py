"""RoleSpec: what a worker reads is the config itself, with the derived sizes computed from it.

Each expected value is worked out by hand from the keys set in the test.
"""
from __future__ import annotations

import os
import pickle

import pytest

from megaflow.config import ConfigError
from megaflow.topology import run_from_dict
from megaflow.topology.role_spec import RoleSpec

# 4 prompts x n=2 = 8 samples per step; 2 ranks at tp=1: dp=2
SMALL = dict(data={"train_batch_size": 4, "max_prompt_length": 24},
             rollout={"n": 2, "response_length": 8},
             actor={"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 1, "log_prob_micro_batch_size_per_gpu": 3,
                    "ppo_epochs": 3, "optim": {"lr_decay_style": "cosine", "lr_warmup_steps": 2}})


def test_actor_sizes_follow_the_config(tiny):
    spec = RoleSpec(run_from_dict(tiny(**SMALL)), "actor", 5)
    assert spec.section is spec.config.actor and spec.head == "lm" and spec.trains
    sizes = spec.micro_batches
    assert (sizes.max_seq_len, sizes.update_micro_batch_size, sizes.forward_micro_batch_size) == (24 + 8, 1, 3)
    assert (sizes.update_max_tokens, sizes.forward_max_tokens) == (None, None)
    assert spec.mini_batch_size_per_dp_rank == 2 * 2 // 2  # prompts x n / dp
    # 5 training steps x (4 / 2 mini-batches) x 3 epochs
    assert spec.lr_decay_steps == 5 * 2 * 3
    assert spec.parallel.dp == 2 and spec.shuffle is True


def test_forward_only_roles_have_no_update_sizes(tiny):
    cfg = run_from_dict(tiny(ref={"enabled": True, "log_prob_micro_batch_size_per_gpu": 5, "param_offload": True},
                             algorithm={"use_kl_loss": True}))
    ref = RoleSpec(cfg, "ref", 3)
    assert ref.head == "lm" and not ref.trains
    assert (ref.micro_batches.update_micro_batch_size, ref.micro_batches.forward_micro_batch_size) == (None, 5)
    assert ref.offload == {"params": True, "grads": False, "optimizer": False}
    assert ref.model_overrides == {"sequence_parallel": False}
    with pytest.raises(ValueError, match="role 'ref' does not train"):
        ref.lr_decay_steps


def test_model_sources_of_the_roles(tiny, tmp_path):
    cfg = run_from_dict(tiny(critic={"enabled": True, "path": "~/critic_ckpt"},
                             algorithm={"adv_estimator": "gae"}, rollout={"n": 1}))
    assert RoleSpec(cfg, "actor", 1).model_source.key == "model.hf_config"
    assert RoleSpec(cfg, "actor", 1).hf_config()["hidden_size"] == 64
    critic = RoleSpec(cfg, "critic", 1).model_source
    assert critic.path == os.path.expanduser("~/critic_ckpt") and critic.key == "critic.path"
    assert critic.hf_config is None
    with pytest.raises(ConfigError) as err:
        RoleSpec(cfg, "critic", 1).hf_config()  # no config.json there
    assert err.value.key == "critic.path"
    assert RoleSpec(cfg, "critic", 1).head == "value"
    rm_hf = dict(tiny()["model"]["hf_config"], hidden_size=32)
    cfg = run_from_dict(tiny(reward_model={"enabled": True, "hf_config": rm_hf}))
    assert RoleSpec(cfg, "reward_model", 1).hf_config()["hidden_size"] == 32
    assert RoleSpec(cfg, "reward_model", 1).head == "reward"


def test_offload_and_recompute_knobs_reach_the_spec(tiny):
    cfg = run_from_dict(tiny(actor={"grad_offload": True, "recompute_granularity": "full",
                                    "recompute_num_layers": 2, "shuffle": False}))
    spec = RoleSpec(cfg, "actor", 1)
    assert spec.offload == {"params": False, "grads": True, "optimizer": False}
    assert spec.model_overrides == dict(sequence_parallel=False, recompute_granularity="full",
                                        recompute_method="uniform", recompute_num_layers=2)
    assert spec.shuffle is False
    gpu = run_from_dict(tiny(actor={"tp": 2, "sequence_parallel": True, "recompute_granularity": "selective"},
                             resources={"use_gpu": True}))
    assert RoleSpec(gpu, "actor", 1).model_overrides == dict(sequence_parallel=True, recompute_granularity="selective")


def test_spec_pickles_with_the_standard_pickler_and_through_ray(tiny):
    from ray import cloudpickle

    spec = RoleSpec(run_from_dict(tiny(**SMALL)), "actor", 5)
    for dumps, loads in ((pickle.dumps, pickle.loads), (cloudpickle.dumps, cloudpickle.loads)):
        back = loads(dumps(spec))
        assert back == spec and back.lr_decay_steps == spec.lr_decay_steps


def test_bad_roles_are_refused(tiny):
    cfg = run_from_dict(tiny())
    with pytest.raises(ValueError, match="RoleSpec.role must be one of"):
        RoleSpec(cfg, "rollout", 1)
    with pytest.raises(ValueError, match="training_steps must be >= 1"):
        RoleSpec(cfg, "actor", 0)


def test_typed_section_accessors_answer_for_their_own_role_only(tiny):
    cfg = run_from_dict(tiny(critic={"enabled": True}, algorithm={"adv_estimator": "gae"}, rollout={"n": 1}))
    actor, critic = RoleSpec(cfg, "actor", 1), RoleSpec(cfg, "critic", 1)
    assert actor.actor is cfg.actor and critic.critic is cfg.critic
    with pytest.raises(ValueError, match=r"^RoleSpec\.critic: this is the 'actor' role's spec$"):
        actor.critic
    with pytest.raises(ValueError, match=r"^RoleSpec\.reward_model: this is the 'critic' role's spec$"):
        critic.reward_model


def test_a_moe_actor_builds_its_routers_with_replay_hooks_under_every_router_replay():
    """The routers of a mixture-of-experts actor record their top-k for moe/routing_agreement
    under actor.router_replay=off too (megaflow.megatron.routing_replay); a reference model
    and a dense actor get no hooks (test_offload_and_recompute_knobs_reach_the_spec)."""
    from megaflow.topology import load_run

    for replay in ("off", "R2", "R3"):
        cfg = load_run("tiny_moe_grpo", [f"actor.router_replay={replay}", "ref.enabled=true", "ref.ep=2",
                                         "algorithm.use_kl_loss=true"])
        assert RoleSpec(cfg, "actor", 1).model_overrides["moe_enable_routing_replay"] is True
        assert "moe_enable_routing_replay" not in RoleSpec(cfg, "ref", 1).model_overrides
