"""verl's rollout-correction surface (megaflow.algorithms.off_policy) against values computed
by hand in plain Python on a batch with a hole and an empty row."""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.algorithms.off_policy import (REJECTION_OPTIONS, RejectionBand, bypass_policy_loss,
                                            chained_rejection_mask, icepop_weight_band, offpolicy_metrics,
                                            parse_rejection, rejection_statistic, token_divergence,
                                            truncated_is_weights)

# row 0 full, row 1 with a hole in the middle, row 2 empty
MASK = [[1, 1, 1], [1, 0, 1], [0, 0, 0]]
TRAIN = [[-1.0, -2.0, -0.5], [-0.3, -9.0, -1.2], [-4.0, -4.0, -4.0]]
ROLLOUT = [[-1.2, -1.5, -0.5], [-0.1, 5.0, -2.2], [0.0, 0.0, 0.0]]
VALID = [(b, t) for b in range(3) for t in range(3) if MASK[b][t]]
ROWS = [[t for t in range(3) if MASK[b][t]] for b in range(3)]


def _lr(b, t):
    return TRAIN[b][t] - ROLLOUT[b][t]  # row 0: 0.2, -0.5, 0.0; row 1: -0.2, -, 1.0


def _t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


K = {"k1": lambda x: -x, "k2": lambda x: x * x / 2, "k3": lambda x: math.exp(x) - 1 - x}


def test_k1_k2_k3_per_token():
    x = _t([[0.3, -1.0, 2.0]])
    for name, f in K.items():
        torch.testing.assert_close(token_divergence(x, name), _t([[f(0.3), f(-1.0), f(2.0)]]))


@pytest.mark.parametrize("option", REJECTION_OPTIONS)
def test_rejection_statistic_by_hand(option):
    level, k = option.rsplit("_", 1)
    lr = torch.where(_t(MASK) != 0, _t(TRAIN) - _t(ROLLOUT), torch.zeros(3, 3))
    stat = rejection_statistic(lr, _t(MASK) != 0, option)
    for b in range(3):
        values = [K[k](_lr(b, t)) for t in ROWS[b]]
        agg = {"seq_sum": sum, "seq_mean": lambda v: sum(v) / len(v), "seq_max": max}
        for t in range(3):
            if level == "token":
                expected = K[k](_lr(b, t)) if MASK[b][t] else 0.0
            else:
                expected = agg[level](values) if values else 0.0  # an empty row has statistic 0
            assert float(stat[b, t]) == pytest.approx(expected, rel=1e-6, abs=1e-7), (b, t)


def test_parse_rejection_thresholds():
    bands = parse_rejection("token_k1, seq_max_k3", "2.0")  # one value shared: k1 -> [1/2, 2]
    assert bands == [RejectionBand("token_k1", 2.0, 0.5), RejectionBand("seq_max_k3", 2.0)]
    assert parse_rejection("token_k1,seq_mean_k2", "0.8_1.5,0.01") == [
        RejectionBand("token_k1", 1.5, 0.8), RejectionBand("seq_mean_k2", 0.01)]
    assert parse_rejection("token_k2,token_k2", 0.1) == [RejectionBand("token_k2", 0.1)]  # duplicates dropped
    for options, spec, fragment in [("seq_max_k1", "2", "seq_max_k1"), ("token_k1,token_k2", "1,2,3", "one per"),
                                    ("token_k2", "0.1_1", "one upper bound"), ("token_k1", "2_1", "lower"),
                                    ("token_k3", "-1", "positive"), ("token_k3", "x", "not a number"), ("", "1", "one")]:
        with pytest.raises(ValueError, match=fragment):
            parse_rejection(options, spec)


def test_chained_options_are_and_ed_with_verls_fractions():
    # token_k1 in [log 0.7, log 1.5] on k1 = -lr: keeps 0.2, 0.0, -0.2 (k1 = -0.2, 0, 0.2), rejects
    # lr = -0.5 (k1 = 0.5 > log 1.5 = 0.405) and lr = 1.0 (k1 = -1 < log 0.7 = -0.357)
    # seq_max_k2 <= 0.1: row 0 max k2 = 0.125 -> whole row 0 out; row 1 max k2 = 0.5 -> out
    kept, m = chained_rejection_mask(_t(TRAIN), _t(ROLLOUT), _t(MASK), parse_rejection("token_k1", "0.7_1.5"))
    assert kept.tolist() == [[1, 0, 1], [1, 0, 0], [0, 0, 0]]
    assert m["rollout_rs_token_k1_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_token_k1_seq_masked_fraction"] == pytest.approx(2 / 2)  # over rows with tokens
    assert m["rollout_rs_seq_masked_fraction"] == pytest.approx(2 / 3)  # over all rows, as verl
    bands = parse_rejection("token_k1,seq_max_k2", "0.7_1.5,0.2")  # row 0: 0.125 <= 0.2 passes
    kept, m = chained_rejection_mask(_t(TRAIN), _t(ROLLOUT), _t(MASK), bands)
    assert kept.tolist() == [[1, 0, 1], [0, 0, 0], [0, 0, 0]]
    assert m["rollout_rs_seq_max_k2_masked_fraction"] == pytest.approx(2 / 5)
    assert m["rollout_rs_masked_fraction"] == pytest.approx(3 / 5)


def test_is_weights_truncated_and_batch_normalised():
    w, f = truncated_is_weights(_t(TRAIN), _t(ROLLOUT), _t(MASK), level="token", threshold=2.0)
    expected = [[math.exp(_lr(b, t)) if MASK[b][t] else 0.0 for t in range(3)] for b in range(3)]
    expected[1][2] = 2.0  # exp(1.0) truncated
    torch.testing.assert_close(w, _t(expected))
    assert f == 1.0
    wn, f = truncated_is_weights(_t(TRAIN), _t(ROLLOUT), _t(MASK), level="token", threshold=2.0, batch_normalize=True)
    mean = sum(expected[b][t] for b, t in VALID) / 5
    assert f == pytest.approx(mean)
    torch.testing.assert_close(wn, _t(expected) / mean)
    # sequence weights: exp(sum lr) per row, mean over the two rows with tokens (the empty row is not counted)
    s0, s1 = math.exp(-0.3), min(math.exp(0.8), 2.0)
    ws, f = truncated_is_weights(_t(TRAIN), _t(ROLLOUT), _t(MASK), level="sequence", threshold=2.0,
                                 batch_normalize=True)
    assert f == pytest.approx((s0 + s1) / 2)
    torch.testing.assert_close(ws, _t([[s0] * 3, [s1, 0, s1], [0] * 3]) / f)


def test_icepop_weight_band_zeroes_weights_outside_and_keeps_the_rest():
    w = _t([[0.3, 0.9, 1.4, 5.0]])
    torch.testing.assert_close(icepop_weight_band(w, lower=0.5, upper=2.0), _t([[0.0, 0.9, 1.4, 0.0]]))
    with pytest.raises(ValueError, match="lower <= upper"):
        icepop_weight_band(w, lower=2.0, upper=1.0)


def test_offpolicy_metrics_match_verls_definitions_with_the_empty_row():
    m_train = [sum(TRAIN[b][t] for t in ROWS[b]) / len(ROWS[b]) if ROWS[b] else 0.0 for b in range(3)]
    m_roll = [sum(ROLLOUT[b][t] for t in ROWS[b]) / len(ROWS[b]) if ROWS[b] else 0.0 for b in range(3)]
    diff = [r - t for r, t in zip(m_roll, m_train)]
    lrs = [_lr(b, t) for b, t in VALID]
    expected = {
        "training_ppl": sum(math.exp(-x) for x in m_train) / 3, "training_log_ppl": -sum(m_train) / 3,
        "rollout_ppl": sum(math.exp(-x) for x in m_roll) / 3, "rollout_log_ppl": -sum(m_roll) / 3,
        "kl": -sum(lrs) / 5, "k3_kl": sum(math.exp(x) - x - 1 for x in lrs) / 5,
        "log_ppl_diff": sum(diff) / 3, "log_ppl_abs_diff": sum(abs(d) for d in diff) / 3,
        "log_ppl_diff_max": max(diff), "log_ppl_diff_min": min(diff),
        "ppl_ratio": sum(math.exp(d) for d in diff) / 3,
        "chi2_token": sum(math.exp(2 * x) for x in lrs) / 5 - 1,
        "chi2_seq": sum(math.exp(2 * sum(_lr(b, t) for t in ROWS[b])) for b in range(3)) / 3 - 1,
    }
    got = offpolicy_metrics(_t(TRAIN), _t(ROLLOUT), _t(MASK))
    assert got == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ValueError, match="valid token"):
        offpolicy_metrics(_t(TRAIN), _t(ROLLOUT), torch.zeros(3, 3))


def _bypass_inputs():
    lp = _t(TRAIN, torch.float64).requires_grad_()
    adv = _t([[1.0, -1.0, 0.5], [2.0, 3.0, -0.5], [1.0, 1.0, 1.0]], torch.float64)
    return lp, _t(ROLLOUT, torch.float64), adv, _t(MASK, torch.float64)


def test_bypass_reinforce_recomputes_is_and_rejection_and_keeps_rejected_tokens_in_the_denominator():
    lp, rollout, adv, mask = _bypass_inputs()
    loss, m = bypass_policy_loss(lp, rollout, adv, mask, loss_type="reinforce", is_level="token",
                                 is_threshold=2.0, rejection=parse_rejection("token_k1", "0.7_1.5"))
    kept = {(0, 0), (0, 2), (1, 0)}  # see test_chained_options_are_and_ed_with_verls_fractions
    w = {k: min(math.exp(_lr(*k)), 2.0) for k in VALID}
    a = adv.tolist()
    expected = sum(-a[b][t] * TRAIN[b][t] * w[(b, t)] for b, t in kept) / 5  # 5 valid tokens, not 3 kept
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)  # float32 weights
    loss.backward()
    grad = [[(-a[b][t] * w[(b, t)] / 5 if (b, t) in kept else 0.0) for t in range(3)] for b in range(3)]
    torch.testing.assert_close(lp.grad, _t(grad, torch.float64), rtol=1e-6, atol=1e-9)  # w: stop-gradient
    assert float(m["rollout_rs_masked_fraction"]) == pytest.approx(2 / 5)
    # the engine's global counts (fixed before rejection) are the denominators when given
    loss_g, _ = bypass_policy_loss(lp, rollout, adv, mask, loss_type="reinforce", is_level="token",
                                   is_threshold=2.0, rejection=parse_rejection("token_k1", "0.7_1.5"),
                                   global_num_tokens=10)
    assert float(loss_g.detach()) == pytest.approx(expected * 5 / 10, rel=1e-6)


def test_bypass_ppo_clip_uses_the_rollout_ratio_without_is_weights():
    lp, rollout, adv, mask = _bypass_inputs()
    loss, _ = bypass_policy_loss(lp, rollout, adv, mask, loss_type="ppo_clip", is_level="token",
                                 rejection=parse_rejection("token_k1", "0.7_1.5"))
    kept = {(0, 0), (0, 2), (1, 0)}
    a = adv.tolist()
    total = 0.0
    for b, t in kept:
        r = math.exp(_lr(b, t))
        total += max(-a[b][t] * r, -a[b][t] * min(max(r, 0.8), 1.2))
    assert float(loss.detach()) == pytest.approx(total / 5, rel=1e-9)
    with pytest.raises(ValueError, match="ppo_clip, reinforce"):
        bypass_policy_loss(lp, rollout, adv, mask, loss_type="gspo")
