"""Rollout correction and CISPO against hand computations on small tensors (empty
responses, all-rejected groups and masks with holes included). The controller stage and
the config refusals: tests/config/test_config_rollout_correction.py."""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.algorithms import (cispo_policy_loss, importance_weights, ppo_policy_loss, rejection_mask,
                                 rollout_correction_metrics)

# 3 responses of up to 3 tokens: row 0 full, row 1 with a hole in the middle, row 2 empty
MASK = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 0]])
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -9.0, -1.2], [-4.0, -4.0, -4.0]])
ROLLOUT = torch.tensor([[-1.2, -1.5, -0.5], [-0.1, 5.0, -2.2], [0.0, 0.0, 0.0]])
# delta = old - rollout on valid tokens: row 0 [0.2, -0.5, 0], row 1 [-0.2, -, 1.0]
D0, D1 = [0.2, -0.5, 0.0], [-0.2, 1.0]


def test_token_weights_are_truncated_exp_of_delta():
    w = importance_weights(OLD, ROLLOUT, MASK, level="token", threshold=2.0)
    expected = torch.tensor([[math.exp(0.2), math.exp(-0.5), 1.0], [math.exp(-0.2), 0.0, 2.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected)  # exp(1.0) = 2.718 truncated to 2


def test_sequence_and_geometric_weights_are_per_row():
    seq = importance_weights(OLD, ROLLOUT, MASK, level="sequence", threshold=10.0)
    geo = importance_weights(OLD, ROLLOUT, MASK, level="geometric", threshold=10.0)
    s0, s1 = math.exp(sum(D0)), math.exp(sum(D1))
    g0, g1 = math.exp(sum(D0) / 3), math.exp(sum(D1) / 2)
    torch.testing.assert_close(seq, torch.tensor([[s0] * 3, [s1, 0.0, s1], [0.0] * 3]))
    torch.testing.assert_close(geo, torch.tensor([[g0] * 3, [g1, 0.0, g1], [0.0] * 3]))
    capped = importance_weights(OLD, ROLLOUT, MASK, level="sequence", threshold=1.5)
    assert float(capped[1, 0]) == 1.5 and float(capped[0, 0]) == pytest.approx(s0)  # s1 = 2.23 > 1.5


def test_token_rejection_is_icepop_band():
    kept = rejection_mask(OLD, ROLLOUT, MASK, mode="token", lower=0.7, upper=1.5)
    # ratios row 0: 1.22, 0.61 (out), 1.0; row 1: 0.82, (hole), 2.72 (out)
    assert kept.tolist() == [[1, 0, 1], [1, 0, 0], [0, 0, 0]]


@pytest.mark.parametrize("mode, lower, upper, expected", [
    ("geometric", 0.8, 1.2, [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),  # geo means 0.905, 1.49
    ("seq_sum", -0.5, 0.5, [[1, 1, 1], [0, 0, 0], [0, 0, 0]]),  # sums -0.3, 0.8
    ("seq_mean", 0.3, 0.5, [[0, 0, 0], [1, 0, 1], [0, 0, 0]]),  # means -0.1, 0.4
])
def test_sequence_rejection_keeps_or_drops_whole_rows(mode, lower, upper, expected):
    assert rejection_mask(OLD, ROLLOUT, MASK, mode=mode, lower=lower, upper=upper).tolist() == expected


def test_metrics_by_hand_including_an_all_rejected_batch():
    kept = torch.zeros_like(MASK)  # everything rejected
    w = importance_weights(OLD, ROLLOUT, MASK, level="token", threshold=2.0)
    m = rollout_correction_metrics(OLD, ROLLOUT, MASK, weights=w, kept_mask=kept)
    deltas = D0 + D1
    assert m["mismatch_mean"] == pytest.approx(sum(abs(d) for d in deltas) / 5)
    assert m["mismatch_max"] == pytest.approx(1.0)
    assert m["token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(d)) for d in deltas) / 5)
    assert m["seq_sum_kl"] == pytest.approx((-sum(D0) - sum(D1)) / 2)  # the empty row is not a sequence
    assert m["weight_mean"] == pytest.approx(float(w.sum()) / 5) and m["weight_max"] == pytest.approx(2.0)
    assert m["rejected_token_fraction"] == 1.0 and m["fully_rejected_seq_fraction"] == 1.0


def test_empty_batch_metrics_are_neutral():
    empty = torch.zeros_like(MASK)
    m = rollout_correction_metrics(OLD, ROLLOUT, empty, weights=torch.zeros(3, 3), kept_mask=empty)
    assert m == dict(mismatch_mean=0.0, mismatch_max=0.0, token_mult_prob_error=1.0, seq_sum_kl=0.0, weight_mean=0.0,
                     weight_max=0.0, rejected_token_fraction=0.0, fully_rejected_seq_fraction=0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(level="token", threshold=0.0), "threshold must be > 0"),
    (dict(level="seq", threshold=2.0), "level"),
])
def test_bad_weight_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        importance_weights(OLD, ROLLOUT, MASK, **kwargs)


def test_bad_rejection_bands():
    with pytest.raises(ValueError, match="lower <= upper"):
        rejection_mask(OLD, ROLLOUT, MASK, mode="seq_sum", lower=1.0, upper=0.0)
    with pytest.raises(ValueError, match="lower must be > 0"):
        rejection_mask(OLD, ROLLOUT, MASK, mode="token", lower=0.0, upper=2.0)


def test_weights_multiply_the_ppo_token_loss():
    lp = torch.tensor([[-1.0, -2.0, -0.4], [-0.2, -1.0, -1.0], [0.0, 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 0.5], [2.0, 0.0, -0.5], [0.0, 0.0, 0.0]])
    w = importance_weights(OLD, ROLLOUT, MASK, level="token", threshold=2.0)
    weighted, _ = ppo_policy_loss(lp, OLD, adv, MASK, is_weights=w, clip_ratio_high=10.0, clip_ratio_low=0.9)
    # with wide clips the per-token loss is -A r; token-mean over the 5 valid tokens
    ratio = (lp.detach() - OLD).exp()
    expected = float((-adv * ratio * w * MASK).sum() / 5)
    assert float(weighted.detach()) == pytest.approx(expected, rel=1e-6)


def test_cispo_matches_hand_formula_and_keeps_every_token_gradient():
    lp = torch.tensor([[-0.5, -2.0, -0.4], [-0.2, -1.0, -1.0], [0.0, 0.0, 0.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 0.5], [2.0, 0.0, -0.5], [0.0, 0.0, 0.0]])
    loss, metrics = cispo_policy_loss(lp, OLD, adv, MASK, clip_ratio_low=0.99, clip_ratio_high=0.2)
    ratio = (lp.detach() - OLD).exp()
    weight = ratio.clamp(0.01, 1.2)  # MiniMax-M1's setting: the lower bound never binds here
    expected = -(weight * adv * lp.detach() * MASK).sum() / 5
    assert float(loss.detach()) == pytest.approx(float(expected), rel=1e-6)
    loss.backward()
    # d/dlp of -sg[w] A lp / 5 = -w A / 5 on every valid token, also where the ratio was truncated
    torch.testing.assert_close(lp.grad, -(weight * adv * MASK) / 5)
    assert float(ratio[0, 0]) > 1.2  # token (0, 0) is truncated, yet its gradient above is not zero
    assert float(metrics["clip_fraction"]) == pytest.approx(float(((ratio > 1.2) & (MASK != 0)).sum()) / 5)
    with pytest.raises(ValueError, match="dual clip"):
        cispo_policy_loss(lp, OLD, adv, MASK, clip_ratio_c=3.0)
