"""Knobs that are refused at load until they are built, and the LR-schedule horizon.

Each refusal is a ``ConfigError`` naming the dotted key, raised by ``run_from_dict``
(what ``load_run`` and ``--dry-run`` run before any process starts).
"""
from __future__ import annotations

import pytest

from megaflow.config import ConfigError
from megaflow.topology import lr_schedule_steps, run_from_dict


@pytest.mark.parametrize("sections, key, fragment", [
    ({"actor": {"cp": 2}, "resources": {"procs_per_node": 2}}, "actor.cp", "context parallelism is not supported"),
    ({"actor": {"pp": 2, "vpp": 2}, "resources": {"procs_per_node": 2}}, "actor.vpp",
     "virtual pipeline stages are not supported"),
    ({"rollout": {"engine": "hf"}}, "rollout.engine", "'hf'"),
    ({"actor": {"recompute_method": "uniform"}}, "actor.recompute_method", "applies to actor.recompute_granularity='full'"),
    ({"critic": {"recompute_granularity": "selective", "recompute_num_layers": 2}}, "critic.recompute_num_layers",
     "applies to critic.recompute_granularity='full'"),
    ({"actor": {"recompute_granularity": "full", "recompute_num_layers": 0}}, "actor.recompute_num_layers", "> 0"),
    ({"actor": {"optim": {"lr_warmup_steps": 4, "lr_decay_steps": 4}}}, "actor.optim.lr_decay_steps",
     "must exceed actor.optim.lr_warmup_steps=4"),
])
def test_unbuilt_or_inconsistent_knobs_are_refused_by_name(tiny, sections, key, fragment):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(**sections))
    assert err.value.key == key
    assert fragment in str(err.value)


def test_full_recompute_knobs_are_accepted(tiny):
    cfg = run_from_dict(tiny(actor={"recompute_granularity": "full", "recompute_method": "block",
                                    "recompute_num_layers": 2}))
    assert (cfg.actor.recompute_method, cfg.actor.recompute_num_layers) == ("block", 2)


def test_decay_horizon_is_the_runs_optimizer_steps(tiny):
    # 16 prompts per step / 4 per mini-batch = 4 mini-batches, x 3 PPO epochs = 12 updates per step
    cfg = run_from_dict(tiny(actor={"ppo_mini_batch_size": 4, "ppo_epochs": 3, "ppo_micro_batch_size_per_gpu": 4,
                                    "optim": {"lr_decay_style": "cosine", "lr_warmup_steps": 5}}))
    assert lr_schedule_steps(cfg, "actor", 10) == 120
    explicit = run_from_dict(tiny(actor={"optim": {"lr_decay_style": "linear", "lr_decay_steps": 50}}))
    assert lr_schedule_steps(explicit, "actor", 10) == 50


def test_warmup_as_long_as_the_run_is_refused_for_a_decaying_schedule(tiny):
    cfg = run_from_dict(tiny(actor={"optim": {"lr_decay_style": "cosine", "lr_warmup_steps": 8}}))
    with pytest.raises(ConfigError) as err:
        lr_schedule_steps(cfg, "actor", 8)  # one update per step: 8 updates, all warm-up
    assert err.value.key == "actor.optim.lr_warmup_steps" and "trainer.total_steps" in str(err.value)
    constant = run_from_dict(tiny(actor={"optim": {"lr_warmup_steps": 8}}))
    assert lr_schedule_steps(constant, "actor", 8) == 9  # constant: only needs to exceed the warm-up


def test_token_budgets_reach_the_engines_and_small_budgets_are_refused(tiny):
    from megaflow.topology.role_spec import RoleSpec

    tree = tiny(actor={"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 3000,
                       "log_prob_max_token_len_per_gpu": 4000, "ppo_micro_batch_size_per_gpu": 3},
                data={"max_prompt_length": 100}, rollout={"response_length": 200})
    cfg = run_from_dict(tree)  # the row count 3 is not checked against the split any more
    engine = RoleSpec(cfg, "actor", 1).micro_batches
    assert (engine.update_max_tokens, engine.forward_max_tokens) == (3000, 4000)
    fixed = RoleSpec(run_from_dict(tiny()), "actor", 1).micro_batches
    assert (fixed.update_max_tokens, fixed.forward_max_tokens) == (None, None)
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor={"use_dynamic_bsz": True, "log_prob_max_token_len_per_gpu": 250},
                           data={"max_prompt_length": 100}, rollout={"response_length": 200}))
    assert err.value.key == "actor.log_prob_max_token_len_per_gpu" and "= 300" in str(err.value)


def test_logits_chunk_tokens_reach_the_actor_and_ref_engines(tiny):
    from megaflow.topology.role_spec import RoleSpec

    cfg = run_from_dict(tiny(actor={"logits_chunk_tokens": 64}, ref={"enabled": True, "logits_chunk_tokens": 32},
                             algorithm={"use_kl_loss": True}))
    assert RoleSpec(cfg, "actor", 1).section.logits_chunk_tokens == 64
    assert RoleSpec(cfg, "ref", 1).section.logits_chunk_tokens == 32
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor={"logits_chunk_tokens": 0}))
    assert err.value.key == "actor.logits_chunk_tokens"


def test_the_plan_sizes_activations_from_the_token_budget(tiny):
    from megaflow.dryrun import build_plan

    def actor_activations(**actor):
        tree = tiny(actor=actor, data={"max_prompt_length": 100}, rollout={"response_length": 156})
        return build_plan(run_from_dict(tree)).role("actor").memory.activations

    fixed = actor_activations(ppo_micro_batch_size_per_gpu=4)
    # a budget of 4 full-length (256-token) rows per micro-batch plans the same activations
    assert actor_activations(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=4 * 256) == pytest.approx(fixed)
    assert actor_activations(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=8 * 256) > fixed


def test_the_plan_counts_the_auto_sized_kv_cache(tiny):
    from megaflow.dryrun import build_plan
    from megaflow.dryrun.memory import cpu_kv_cache_bytes

    fixed = run_from_dict(tiny())
    auto = run_from_dict(tiny(rollout={"cpu_kv_cache_auto": True}))
    assert cpu_kv_cache_bytes(fixed) == 2**30
    assert 0 < cpu_kv_cache_bytes(auto) < 2**30
    assert build_plan(auto).rollout.memory.kv_reserved == cpu_kv_cache_bytes(auto)
    assert build_plan(fixed).rollout.memory.kv_reserved == 2**30
