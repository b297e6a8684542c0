"""The rollout-correction stage of the controller (on a batch with a hole and an empty
response) and the refusals of ``algorithm.rollout_correction`` / CISPO at load."""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.config import ConfigError
from megaflow.topology import run_from_dict

MASK = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -9.0, -1.2], [-4.0, -4.0, -4.0]])
ROLLOUT = torch.tensor([[-1.2, -1.5, -0.5], [-0.1, 5.0, -2.2], [0.0, 0.0, 0.0]])
# delta = old - rollout on valid tokens: row 0 [0.2, -0.5, 0], row 1 [-0.2, -, 1.0]


def _batch():
    from megaflow.protocol import DataProto

    return DataProto.from_dict({"old_log_probs": OLD, "rollout_log_probs": ROLLOUT, "response_mask": MASK,
                                "advantages": torch.ones(3, 3)})


def _rc(tiny, **values):
    return run_from_dict(tiny(algorithm={"rollout_correction": values})).algorithm.rollout_correction


def test_stage_adds_weights_and_rejection_for_the_actor_only(tiny):
    from megaflow.trainer.stages import rollout_correction

    batch = _batch()
    rc = _rc(tiny, is_level="token", rejection="token", rejection_lower=0.7, rejection_upper=1.5)
    actor_batch, metrics = rollout_correction(batch, rc, step=3)
    kept = [[1, 0, 1], [1, 0, 0], [0, 0, 0]]
    assert actor_batch.batch["response_mask"].tolist() == kept
    assert batch.batch["response_mask"].tolist() == MASK.tolist()  # the caller's batch is untouched
    w = actor_batch.batch["rollout_is_weights"]
    assert torch.all(w[torch.tensor(kept) == 0] == 0) and float(w[0, 0]) == pytest.approx(math.exp(0.2))
    assert metrics["rollout_corr/rejected_token_fraction"] == pytest.approx(2 / 5)
    assert metrics["rollout_corr/fully_rejected_seq_fraction"] == 0.0


def test_stage_metrics_without_correction_and_the_mismatch_gate(tiny):
    from megaflow.trainer.stages import RolloutMismatchError, rollout_correction

    batch = _batch()
    same, metrics = rollout_correction(batch, _rc(tiny), step=1)
    assert same is batch and metrics["rollout_corr/mismatch_max"] == pytest.approx(1.0)
    with pytest.raises(RolloutMismatchError, match=r"step 7: .* 0\.38 nats .*max_mismatch=0\.1"):
        rollout_correction(batch, _rc(tiny, max_mismatch=0.1), step=7)


def test_bypass_uses_the_rollout_log_probs(tiny):
    from megaflow.trainer.stages import bypass_old_log_probs, rollout_correction
    from megaflow.protocol import DataProto

    batch = bypass_old_log_probs(DataProto.from_dict({"rollout_log_probs": ROLLOUT, "response_mask": MASK}))
    assert torch.equal(batch.batch["old_log_probs"], ROLLOUT)
    _, metrics = rollout_correction(batch, _rc(tiny, bypass=True), step=1)
    assert metrics["rollout_corr/mismatch_max"] == 0.0  # on-policy by construction: PPO ratio = pi / pi_rollout


def _weights_and_mask(tiny, **values):
    from megaflow.trainer.stages import rollout_correction

    actor_batch, metrics = rollout_correction(_batch(), _rc(tiny, **values), step=1)
    return actor_batch.batch.get("rollout_is_weights"), actor_batch.batch["response_mask"].tolist(), metrics


def test_stage_chained_verl_rejection_with_verls_metrics(tiny):
    # token_k1 in [0.7, 1.5] rejects delta -0.5 and 1.0; seq_max_k2 <= 0.2 then rejects row 1 (k2 = 0.5)
    _, kept, m = _weights_and_mask(tiny, rs="token_k1,seq_max_k2", rs_threshold="0.7_1.5,0.2")
    assert kept == [[1, 0, 1], [0, 0, 0], [0, 0, 0]]
    assert m["rollout_corr/rollout_rs_masked_fraction"] == pytest.approx(3 / 5)
    assert m["rollout_corr/rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)  # all rows, as verl
    assert m["rollout_corr/fully_rejected_seq_fraction"] == pytest.approx(1 / 2)  # megaflow's: rows with none kept
    deltas = [0.2, -0.5, 0.0, -0.2, 1.0]
    assert m["rollout_corr/kl"] == pytest.approx(-sum(deltas) / 5)  # verl's k1 KL(pi_rollout || pi_old)
    assert m["rollout_corr/chi2_token"] == pytest.approx(sum(math.exp(2 * d) for d in deltas) / 5 - 1, rel=1e-5)


def test_is_weight_tokens_chooses_kept_or_every_valid_token(tiny):
    band = dict(is_level="sequence", is_threshold=10.0, rejection="token", rejection_lower=0.7, rejection_upper=1.5)
    w_kept, kept, _ = _weights_and_mask(tiny, **band)
    w_valid, kept_valid, _ = _weights_and_mask(tiny, **band, is_weight_tokens="valid")
    assert kept == kept_valid == [[1, 0, 1], [1, 0, 0], [0, 0, 0]]
    # megaflow: over the kept tokens (row 0: 0.2 + 0; row 1: -0.2); verl: over every valid token
    assert float(w_kept[0, 0]) == pytest.approx(math.exp(0.2)) and float(w_kept[1, 0]) == pytest.approx(math.exp(-0.2))
    assert float(w_valid[0, 0]) == pytest.approx(math.exp(-0.3)) and float(w_valid[1, 0]) == pytest.approx(math.exp(0.8))


def test_icepop_weight_band_and_batch_normalisation(tiny):
    w, kept, _ = _weights_and_mask(tiny, is_level="token", icepop_lower=0.7, icepop_upper=1.5)
    assert kept == MASK.tolist()  # a weight band, not a rejection: every token stays in the denominators
    expected = [[math.exp(0.2), 0.0, 1.0], [math.exp(-0.2), 0.0, 0.0], [0.0] * 3]  # e^-0.5, e^1 outside the band
    torch.testing.assert_close(w, torch.tensor(expected))
    w, _, m = _weights_and_mask(tiny, is_level="token", is_threshold=2.0, is_batch_normalize=True)
    raw = [math.exp(0.2), math.exp(-0.5), 1.0, math.exp(-0.2), 2.0]
    mean = sum(raw) / 5
    assert m["rollout_corr/rollout_is_batch_norm_factor"] == pytest.approx(mean)
    assert float(w[1, 2]) == pytest.approx(2.0 / mean) and float(w[0, 0]) == pytest.approx(math.exp(0.2) / mean)


@pytest.mark.parametrize("preset, explicit", [
    ("decoupled_geo_rs_token_tis", dict(is_level="token", rs="seq_mean_k1", rs_threshold="0.999_1.001")),
    ("decoupled_k3_rs_seq_tis", dict(is_level="sequence", is_weight_tokens="valid", rs="seq_mean_k3",
                                     rs_threshold="0.01")),
    ("decoupled_seq_is_rs", dict(is_level="sequence", is_weight_tokens="valid", rs="seq_sum_k1",
                                 rs_threshold="0.5_2.0")),
    ("bypass_pg_is", dict(bypass=True, bypass_loss_type="reinforce", is_level="sequence")),
    ("bypass_ppo_clip_geo_rs", dict(bypass=True, rs="seq_mean_k1", rs_threshold="0.999_1.001")),
])
def test_verl_presets_set_verls_keys(tiny, preset, explicit):
    import dataclasses

    rc = _rc(tiny, preset=preset)
    assert dataclasses.replace(rc, preset=None) == _rc(tiny, **explicit)
    assert _rc(tiny, preset=preset, **explicit) == rc  # restating the preset's own values is allowed
    if not rc.bypass:  # the stage applies exactly what the explicit keys apply
        with_preset, with_keys = _weights_and_mask(tiny, preset=preset), _weights_and_mask(tiny, **explicit)
        torch.testing.assert_close(with_preset[0], with_keys[0])
        assert with_preset[1] == with_keys[1] and with_preset[2] == with_keys[2]


def test_a_preset_refuses_a_different_value_of_its_keys(tiny):
    with pytest.raises(ConfigError) as err:
        _rc(tiny, preset="decoupled_k3_rs", rs="token_k3")
    assert err.value.key == "algorithm.rollout_correction.rs" and "algorithm.rollout_correction.preset" in str(err.value)
    with pytest.raises(ConfigError) as err:
        _rc(tiny, preset="tis")
    assert err.value.key == "algorithm.rollout_correction.preset" and "decoupled_token_is" in str(err.value)


@pytest.mark.parametrize("values, key, fragment", [
    (dict(rs="token_k1"), "algorithm.rollout_correction.rs_threshold", "set together with"),
    (dict(rs="token_k4", rs_threshold="2"), "algorithm.rollout_correction.rs", "seq_max_k3"),
    (dict(rs="token_k2", rs_threshold="1,2"), "algorithm.rollout_correction.rs", "one per option"),
    (dict(rs="token_k2", rs_threshold="1", rejection="token", rejection_lower=0.5, rejection_upper=2.0),
     "algorithm.rollout_correction.rs", "excludes"),
    (dict(bypass=True, is_level="token", icepop_lower=0.5, icepop_upper=2.0),
     "algorithm.rollout_correction.icepop_lower", "not supported with"),
    (dict(icepop_lower=0.5, icepop_upper=2.0), "algorithm.rollout_correction.icepop_lower", "needs importance"),
    (dict(is_level="token", icepop_lower=0.5), "algorithm.rollout_correction.icepop_lower", "set together"),
    (dict(is_level="token", icepop_lower=3.0, icepop_upper=2.0), "algorithm.rollout_correction.icepop_lower",
     "0 < lower"),
    (dict(is_batch_normalize=True), "algorithm.rollout_correction.is_batch_normalize", "needs importance"),
    (dict(is_weight_tokens="valid"), "algorithm.rollout_correction.is_weight_tokens", "needs importance"),
    (dict(reject_scope="batch"), "algorithm.rollout_correction.reject_scope", "needs a rejection"),
    (dict(bypass=True, rs="token_k2", rs_threshold="1", reject_scope="batch"),
     "algorithm.rollout_correction.reject_scope", "must be actor with"),
])
def test_verl_rollout_correction_keys_are_refused_by_key(tiny, values, key, fragment):
    with pytest.raises(ConfigError) as err:
        _rc(tiny, **values)
    assert err.value.key == key and fragment in str(err.value)


@pytest.mark.parametrize("values, key, fragment", [
    (dict(is_threshold=-1.0), "algorithm.rollout_correction.is_threshold", "> 0"),
    (dict(rejection="token"), "algorithm.rollout_correction.rejection_lower", "required with"),
    (dict(rejection="seq_sum", rejection_lower=1.0, rejection_upper=-1.0), "algorithm.rollout_correction.rejection_lower",
     "must be <= algorithm.rollout_correction.rejection_upper"),
    (dict(rejection="geometric", rejection_lower=-0.5, rejection_upper=2.0),
     "algorithm.rollout_correction.rejection_lower", "bounds a ratio"),
    (dict(rejection_upper=2.0), "algorithm.rollout_correction.rejection_upper", "only used with a rejection mode"),
    (dict(bypass=True, is_level="geometric"), "algorithm.rollout_correction.is_level", "must be none, token or"),
    (dict(bypass=True, rejection="token", rejection_lower=0.5, rejection_upper=2.0),
     "algorithm.rollout_correction.rejection", "must be none with"),
    (dict(max_mismatch=0.0), "algorithm.rollout_correction.max_mismatch", "> 0"),
])
def test_bad_rollout_correction_config_is_refused_by_key(tiny, values, key, fragment):
    with pytest.raises(ConfigError) as err:
        _rc(tiny, **values)
    assert err.value.key == key and fragment in str(err.value)


def test_cispo_with_dual_clip_is_refused(tiny):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor={"policy_loss": "cispo"}))  # clip_ratio_c defaults to 3.0
    assert err.value.key == "actor.clip_ratio_c" and "cispo" in str(err.value)
    cfg = run_from_dict(tiny(actor={"policy_loss": "cispo", "clip_ratio_c": None}))
    assert cfg.actor.policy_loss == "cispo"


def test_rs_threshold_takes_verls_string_or_number(tiny):
    """verl 0.9.1 types rollout_rs_threshold as str | float and reads a number as str(number):
    a k1 'lower_upper' pair, a single k1 u meaning [1/u, u], a k2/k3 upper bound."""
    from megaflow.algorithms.off_policy import RejectionBand, parse_rejection

    assert _rc(tiny, rs="token_k3", rs_threshold=0.01).rs_threshold == "0.01"
    rc = _rc(tiny, rs="token_k1", rs_threshold=2)
    assert rc.rs_threshold == "2" and parse_rejection(rc.rs, rc.rs_threshold) == [RejectionBand("token_k1", 2.0, 0.5)]
    rc = _rc(tiny, rs="seq_sum_k1,seq_max_k2", rs_threshold="0.5_2.0,0.3")
    assert parse_rejection(rc.rs, rc.rs_threshold) == [RejectionBand("seq_sum_k1", 2.0, 0.5),
                                                       RejectionBand("seq_max_k2", 0.3)]
    for bad in (True, [0.5, 2.0]):
        with pytest.raises(ConfigError) as err:
            _rc(tiny, rs="token_k1", rs_threshold=bad)
        assert err.value.key == "algorithm.rollout_correction.rs_threshold" and "or a number" in str(err.value)
