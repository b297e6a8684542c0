"""GMPO, SAPO, GPG, Clip-Cov, KL-Cov, DRO, DPPO-TV/KL and CISPO's two bounds: the loss value
and d loss / d log_probs against per-token formulas written out by hand in plain Python
(stop-gradients where the papers put them), rollout-correction weights, and the registry."""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.algorithms import (POLICY_LOSSES, cispo_policy_loss, clip_cov_policy_loss, compute_policy_loss,
                                 dppo_kl_policy_loss, dppo_tv_policy_loss, dro_policy_loss, geo_mean_policy_loss,
                                 gpg_policy_loss, kl_cov_policy_loss, sapo_policy_loss)

# two responses: row 0 has three valid tokens, row 1 two (its last token is padding, with a
# NaN log-prob that must not leak)
MASK = [[1, 1, 1], [1, 1, 0]]
OLD = [[-1.0, -2.0, -0.3], [-0.7, -1.5, -3.0]]
LOG_RATIO = [[0.5, -0.6, 0.1], [0.05, -0.3, 0.0]]
ADV = [[1.0, 1.0, 1.0], [-0.8, -0.8, -0.8]]
VALID = [(b, t) for b in range(2) for t in range(3) if MASK[b][t]]
N = len(VALID)


def _inputs(log_ratio=LOG_RATIO, adv=ADV):
    old = torch.tensor(OLD, dtype=torch.float64)
    lp = (old + torch.tensor(log_ratio, dtype=torch.float64))
    lp[1, 2] = float("nan")
    lp.requires_grad_()
    return lp, old, torch.tensor(adv, dtype=torch.float64), torch.tensor(MASK, dtype=torch.float64)


def _lp(b, t, log_ratio=LOG_RATIO):
    return OLD[b][t] + log_ratio[b][t]


def _check(loss_fn, expected_loss, expected_grad, log_ratio=LOG_RATIO, adv=ADV, **kwargs):
    lp, old, a, mask = _inputs(log_ratio, adv)
    loss, metrics = loss_fn(lp, old, a, mask, **kwargs)
    assert float(loss.detach()) == pytest.approx(expected_loss, rel=1e-9, abs=1e-12)
    loss.backward()
    grad = [[0.0] * 3 for _ in range(2)]
    for (b, t), g in expected_grad.items():
        grad[b][t] = g
    torch.testing.assert_close(lp.grad, torch.tensor(grad, dtype=torch.float64), rtol=1e-9, atol=1e-12)
    assert not any(v.requires_grad for v in metrics.values())
    return metrics


def test_gpg_is_minus_advantage_times_log_prob():
    loss = sum(-ADV[b][t] * _lp(b, t) for b, t in VALID) / N
    _check(gpg_policy_loss, loss, {(b, t): -ADV[b][t] / N for b, t in VALID})


def test_dro_adds_the_quadratic_log_ratio_penalty():
    beta = 0.3
    loss = sum(-(ADV[b][t] * _lp(b, t) - beta / 2 * LOG_RATIO[b][t] ** 2) for b, t in VALID) / N
    grad = {(b, t): (-ADV[b][t] + beta * LOG_RATIO[b][t]) / N for b, t in VALID}
    _check(dro_policy_loss, loss, grad, dro_beta=beta)


def test_sapo_sigmoid_gate_value_and_gradient():
    tau_pos, tau_neg = 1.0, 1.5
    loss, grad = 0.0, {}
    for b, t in VALID:
        n_b, a, r = sum(MASK[b]), ADV[b][t], math.exp(LOG_RATIO[b][t])
        tau = tau_pos if a > 0 else tau_neg
        sig = 1 / (1 + math.exp(-tau * (r - 1)))
        loss += -a * 4 / tau * sig / n_b / 2  # seq-mean-token-mean over two rows
        grad[(b, t)] = -a * 4 * sig * (1 - sig) * r / n_b / 2  # d/dlog p of -A (4/tau) sigmoid(tau (e^l - 1))
    _check(sapo_policy_loss, loss, grad, tau_pos=tau_pos, tau_neg=tau_neg)
    lp, old, a, mask = _inputs()
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        sapo_policy_loss(lp, old, a, mask, loss_agg_mode="token-mean")


def test_geo_mean_clips_log_ratios_by_advantage_sign_and_cuts_their_gradient():
    low, high = 0.2, 0.4  # row 0 (A > 0): 0.5 > 0.4 is cut; -0.6 below -0.2 is kept (the min keeps it)
    # row 1 (A < 0): -0.3 < -0.2 is cut; 0.05 inside
    loss, grad = 0.0, {}
    for b in range(2):
        toks = [t for t in range(3) if MASK[b][t]]
        a = sum(ADV[b][t] for t in toks) / len(toks)
        s = 1.0 if a > 0 else -1.0
        kept = {t: s * min(s * LOG_RATIO[b][t], s * min(max(LOG_RATIO[b][t], -low), high)) for t in toks}
        ratio = math.exp(sum(kept.values()) / len(toks))
        loss += -a * ratio / 2
        for t in toks:
            raw = kept[t] == LOG_RATIO[b][t]
            grad[(b, t)] = -a * ratio / len(toks) / 2 if raw else 0.0
    metrics = _check(geo_mean_policy_loss, loss, grad, clip_ratio_low=low, clip_ratio_high=high)
    assert grad[(0, 0)] == 0.0 and grad[(0, 1)] != 0.0 and grad[(1, 1)] == 0.0
    assert float(metrics["clip_fraction"]) == pytest.approx(2 / N)


def test_geo_mean_uses_the_geometric_mean_of_the_rows_is_weights():
    lp, old, a, mask = _inputs()
    lp = lp.detach()
    w = torch.tensor([[0.5, 2.0, 1.0], [0.9, 0.4, 7.0]], dtype=torch.float64)
    plain, _ = geo_mean_policy_loss(lp, old, a, mask)
    weighted, _ = geo_mean_policy_loss(lp, old, a, mask, is_weights=w)
    per_row, _ = zip(*[geo_mean_policy_loss(lp[i:i + 1], old[i:i + 1], a[i:i + 1], mask[i:i + 1]) for i in range(2)])
    g = [(0.5 * 2.0 * 1.0) ** (1 / 3), (0.9 * 0.4) ** 0.5]
    assert float(weighted) == pytest.approx((float(per_row[0]) * g[0] + float(per_row[1]) * g[1]) / 2, rel=1e-9)
    assert float(plain) == pytest.approx((float(per_row[0]) + float(per_row[1])) / 2, rel=1e-9)


def _trusted_tv(b, t, low, high):
    p, q = math.exp(_lp(b, t)), math.exp(OLD[b][t])
    return p - q <= high if ADV[b][t] > 0 else p - q >= -low


def _trusted_kl(b, t, low, high):
    p, q = math.exp(_lp(b, t)), math.exp(OLD[b][t])
    kl = q * math.log(q / p) + (1 - q) * math.log((1 - q + 1e-8) / (1 - p + 1e-8))
    return (kl <= high or p <= q) if ADV[b][t] > 0 else (kl <= low or p >= q)


@pytest.mark.parametrize("loss_fn, trusted, low, high", [
    (dppo_tv_policy_loss, _trusted_tv, 0.05, 0.1),
    (dppo_kl_policy_loss, _trusted_kl, 0.001, 0.01),
])
def test_dppo_trust_region_and_truncated_detached_ratio(loss_fn, trusted, low, high):
    c = 1.5  # exp(0.5) = 1.65 is truncated
    loss, grad, outside = 0.0, {}, 0
    for b, t in VALID:
        w = min(math.exp(LOG_RATIO[b][t]), c)
        keep = trusted(b, t, low, high)
        outside += not keep
        loss += -ADV[b][t] * w * _lp(b, t) * keep / N
        grad[(b, t)] = -ADV[b][t] * w * keep / N  # the weight and the mask are stop-gradients
    metrics = _check(loss_fn, loss, grad, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    assert 0 < outside < N  # the example has tokens on both sides of the trust region
    assert float(metrics["clip_fraction"]) == pytest.approx(outside / N)


def _covariances():
    mean_a = sum(ADV[b][t] for b, t in VALID) / N
    mean_lp = sum(_lp(b, t) for b, t in VALID) / N
    return {(b, t): (ADV[b][t] - mean_a) * (_lp(b, t) - mean_lp) for b, t in VALID}


def test_kl_cov_penalises_the_highest_covariance_tokens():
    coef, ratio = 0.7, 0.4  # floor(0.4 * 5) = 2 tokens penalised
    cov = _covariances()
    top = sorted(cov, key=cov.get, reverse=True)[:2]
    loss, grad = 0.0, {}
    for b, t in VALID:
        r, x = math.exp(LOG_RATIO[b][t]), LOG_RATIO[b][t]
        pen = (b, t) in top
        loss += (-ADV[b][t] * r + pen * coef * abs(x)) / N
        grad[(b, t)] = (-ADV[b][t] * r + pen * coef * math.copysign(1.0, x)) / N
    metrics = _check(kl_cov_policy_loss, loss, grad, kl_cov_ratio=ratio, ppo_kl_coef=coef)
    assert float(metrics["clip_fraction"]) == pytest.approx(2 / N)


def test_clip_cov_cuts_a_drawn_token_in_the_covariance_band():
    cov = _covariances()
    eps = 0.2
    by_clip = {(b, t) for b, t in VALID
               if -ADV[b][t] * min(max(math.exp(LOG_RATIO[b][t]), 1 - eps), 1 + eps) > -ADV[b][t] * math.exp(LOG_RATIO[b][t])}
    free = sorted((k for k in VALID if k not in by_clip), key=cov.get)
    # a band that holds exactly one token the PPO clip leaves active: that one is cut
    target = free[-1]
    lb, ub = (cov[free[-2]] + cov[target]) / 2, cov[target] + 1.0
    loss, grad = 0.0, {}
    for b, t in VALID:
        r = math.exp(LOG_RATIO[b][t])
        cut = (b, t) == target
        ppo = max(-ADV[b][t] * r, -ADV[b][t] * min(max(r, 1 - eps), 1 + eps))
        loss += 0.0 if cut else ppo / N
        grad[(b, t)] = 0.0 if cut or (b, t) in by_clip else -ADV[b][t] * r / N
    metrics = _check(clip_cov_policy_loss, loss, grad, clip_ratio_low=eps, clip_ratio_high=eps,
                     clip_cov_ratio=0.2, clip_cov_lb=lb, clip_cov_ub=ub)
    assert float(metrics["clip_fraction"]) == pytest.approx((len(by_clip) + 1) / N)


def test_cispo_clips_its_weight_at_both_bounds_and_keeps_every_gradient():
    low, high = 0.1, 0.3  # exp(0.5) = 1.65 -> 1.3; exp(-0.6) = 0.55 -> 0.9; exp(-0.3) = 0.74 -> 0.9
    weights = {(b, t): min(max(math.exp(LOG_RATIO[b][t]), 1 - low), 1 + high) for b, t in VALID}
    loss = sum(-weights[k] * ADV[k[0]][k[1]] * _lp(*k) for k in VALID) / N
    metrics = _check(cispo_policy_loss, loss, {k: -weights[k] * ADV[k[0]][k[1]] / N for k in VALID},
                     clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=None)
    assert float(metrics["clip_fraction"]) == pytest.approx(3 / N)


@pytest.mark.parametrize("name", ["gpg", "dro", "sapo", "kl_cov", "dppo_tv", "dppo_kl", "clip_cov"])
def test_token_losses_multiply_the_is_weights_into_each_token(name):
    lp, old, a, mask = _inputs()
    w = torch.tensor([[0.5, 2.0, 1.0], [0.9, 0.4, 7.0]], dtype=torch.float64)
    agg = {"loss_agg_mode": "seq-mean-token-mean"} if name == "sapo" else {}
    # with one weight per call, the weighted loss equals the weight times the unweighted one
    plain = [compute_policy_loss(name, lp[b:b + 1, t:t + 1], old[b:b + 1, t:t + 1], a[b:b + 1, t:t + 1],
                                 mask[b:b + 1, t:t + 1], **agg)[0] for b, t in VALID]
    weighted = [compute_policy_loss(name, lp[b:b + 1, t:t + 1], old[b:b + 1, t:t + 1], a[b:b + 1, t:t + 1],
                                    mask[b:b + 1, t:t + 1], is_weights=w[b:b + 1, t:t + 1], **agg)[0]
                for b, t in VALID]
    for (b, t), p, q in zip(VALID, plain, weighted):
        assert float(q) == pytest.approx(float(w[b, t]) * float(p), rel=1e-12, abs=1e-15)


def test_every_registered_loss_runs_on_policy_with_finite_values():
    lp, old, a, mask = _inputs(log_ratio=[[0.0] * 3] * 2)
    for name in POLICY_LOSSES:
        agg = {"loss_agg_mode": "seq-mean-token-mean"} if name in ("sapo", "geo_mean") else {}
        loss, metrics = compute_policy_loss(name, lp, old, a, mask, **agg)
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values()), name
        assert float(metrics["approx_kl"]) == 0.0
    with pytest.raises(ValueError, match="geo_mean, sapo"):
        compute_policy_loss("vanilla", lp, old, a, mask)
