"""Policy losses (PPO, clip-higher, dual clip, GSPO), entropy and the clipped value loss."""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.algorithms import (
    LOSS_AGG_MODES,
    clipped_value_loss,
    compute_policy_loss,
    entropy_bonus,
    entropy_from_logits,
    gspo_policy_loss,
    ppo_policy_loss,
)


def ppo_token_loop(ratio: float, adv: float, low: float, high: float, c: float | None):
    """Scalar PPO loss and (clipped, dual_clipped) flags, written from Schulman eq. 7."""
    unclipped = -adv * ratio
    clipped_value = -adv * min(max(ratio, 1 - low), 1 + high)
    loss = max(unclipped, clipped_value)
    dual = False
    if c is not None and adv < 0 and -adv * c < loss:
        loss, dual = -adv * c, True
    return loss, clipped_value > unclipped, dual


def _one_row(ratios, advantages):
    old = torch.zeros(1, len(ratios), dtype=torch.float64)
    log_probs = torch.tensor([ratios], dtype=torch.float64).log().requires_grad_()
    return log_probs, old, torch.tensor([advantages], dtype=torch.float64), torch.ones(1, len(ratios))


def test_ppo_by_hand_symmetric_and_dual_clip():
    ratios = [1.5, 1.5, 5.0, 0.5, 0.5, 5.0]
    advs = [1.0, -1.0, -1.0, -1.0, 1.0, 1.0]
    log_probs, old, adv, mask = _one_row(ratios, advs)
    loss, m = ppo_policy_loss(log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)
    # -1.2 (clipped) | 1.5 | min(5, 3)=3 (dual) | 0.8 (clipped) | -0.5 | -1.2 (clipped, A>0: no dual)
    expected = [-1.2, 1.5, 3.0, 0.8, -0.5, -1.2]
    assert loss.item() == pytest.approx(sum(expected) / 6)
    assert m["clip_fraction"].item() == pytest.approx(3 / 6)
    assert m["dual_clip_fraction"].item() == pytest.approx(1 / 6)
    assert m["approx_kl"].item() == pytest.approx(-sum(math.log(r) for r in ratios) / 6)
    assert not any(v.requires_grad for v in m.values())
    loss.backward()
    # d(-A r)/d log r = -A r for active tokens, 0 where a clip holds
    expected_grad = [0.0, 1.5, 0.0, 0.0, -0.5, 0.0]
    assert (log_probs.grad[0] * 6).tolist() == pytest.approx(expected_grad)


def test_clip_higher_asymmetric_range():
    log_probs, old, adv, mask = _one_row([1.25, 1.25, 0.75], [1.0, -1.0, -1.0])
    loss, m = ppo_policy_loss(log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss.item() == pytest.approx((-1.25 + 1.25 + 0.8) / 3)  # 1.25 < 1.28: not clipped
    assert m["clip_fraction"].item() == pytest.approx(1 / 3)


def test_on_policy_ratio_one_no_clipping(make_batch):
    b = make_batch(seed=0)
    log_probs = b["old_log_probs"].clone().requires_grad_()
    loss, m = ppo_policy_loss(log_probs, b["old_log_probs"], b["advantages"], b["response_mask"])
    mask = b["response_mask"]
    n = int(mask.sum())
    adv = torch.nan_to_num(b["advantages"])
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / n, rel=1e-12)
    assert m["clip_fraction"].item() == 0 and m["approx_kl"].item() == 0
    loss.backward()
    assert torch.allclose(log_probs.grad, -adv * mask / n)


@pytest.mark.parametrize("clip_ratio_c", [None, 3.0])
def test_ppo_matches_token_loop_far_outside_band(make_batch, clip_ratio_c):
    b = make_batch(seed=3)
    mask = b["response_mask"]
    loss, m = ppo_policy_loss(b["log_probs"], b["old_log_probs"], b["advantages"], mask,
                              clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c)
    total = clipped = dual = n = 0
    for i, t in mask.nonzero().tolist():
        ratio = math.exp(b["log_probs"][i, t].item() - b["old_log_probs"][i, t].item())
        value, is_clipped, is_dual = ppo_token_loop(ratio, b["advantages"][i, t].item(), 0.2, 0.28, clip_ratio_c)
        total, clipped, dual, n = total + value, clipped + is_clipped, dual + is_dual, n + 1
    assert loss.item() == pytest.approx(total / n, rel=1e-10)
    assert m["clip_fraction"].item() == pytest.approx(clipped / n)
    assert m["dual_clip_fraction"].item() == pytest.approx(dual / n)
    assert 0 < clipped < n and (clip_ratio_c is None or dual > 0)


def test_gspo_value_and_gradient_by_loop(make_batch):
    b = make_batch(seed=6)
    mask = b["response_mask"]
    adv = torch.nan_to_num(b["advantages"])
    log_probs = b["log_probs"].clone().requires_grad_()
    low, high = 0.1, 0.15
    loss, m = gspo_policy_loss(log_probs, b["old_log_probs"], adv, mask, clip_ratio_low=low, clip_ratio_high=high)
    rows = [r for r in range(mask.shape[0]) if mask[r].any()]
    total, grad_ref = 0.0, torch.zeros_like(adv)
    for r in rows:
        idx = mask[r].nonzero().flatten().tolist()
        s = math.exp(sum(b["log_probs"][r, t].item() - b["old_log_probs"][r, t].item() for t in idx) / len(idx))
        for t in idx:
            value, is_clipped, _ = ppo_token_loop(s, adv[r, t].item(), low, high, None)
            total += value / len(idx)
            grad_ref[r, t] = 0.0 if is_clipped else -adv[r, t].item() * s / len(idx) / len(rows)
    assert loss.item() == pytest.approx(total / len(rows), rel=1e-10)
    loss.backward()
    assert torch.allclose(log_probs.grad, grad_ref, atol=1e-12)
    assert 0 < m["clip_fraction"].item() < 1


def test_gspo_token_equals_sequence_level_gspo_for_sequence_advantages(make_batch):
    b = make_batch(seed=8)
    mask = b["response_mask"]
    seq_adv = torch.linspace(-1.5, 2.0, mask.shape[0], dtype=torch.float64)
    adv = seq_adv.unsqueeze(-1) * mask
    lp_token = torch.nan_to_num(b["log_probs"]).requires_grad_()
    lp_seq = torch.nan_to_num(b["log_probs"]).requires_grad_()
    old = torch.nan_to_num(b["old_log_probs"])
    loss, _ = gspo_policy_loss(lp_token, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    # sequence-level GSPO objective with a differentiable s_i
    valid = mask.sum(-1) > 0
    s = torch.exp(((lp_seq - old) * mask).sum(-1) / mask.sum(-1).clamp_min(1))
    per_seq = torch.maximum(-seq_adv * s, -seq_adv * s.clamp(0.8, 1.2))
    seq_loss = per_seq[valid].mean()
    seq_loss.backward()
    loss.backward()
    assert loss.item() == pytest.approx(seq_loss.item(), rel=1e-12)
    assert torch.allclose(lp_token.grad, lp_seq.grad, atol=1e-12)


def test_policy_loss_registry_and_errors():
    log_probs, old, adv, mask = _one_row([1.0, 1.1], [0.5, -0.5])
    for name in ("ppo", "gspo", "cispo", "clip_cov", "dppo_tv", "dppo_kl"):
        loss, _ = compute_policy_loss(name, log_probs, old, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
        assert loss.shape == ()
    with pytest.raises(TypeError, match="clip_ratio_low"):  # a knob the loss does not read
        compute_policy_loss("gpg", log_probs, old, adv, mask, clip_ratio_low=0.2)
    with pytest.raises(ValueError, match="ppo, gspo"):
        compute_policy_loss("dpo", log_probs, old, adv, mask)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_policy_loss(log_probs, old, adv, mask, clip_ratio_c=0.9)
    with pytest.raises(ValueError, match="clip_ratio_low"):
        ppo_policy_loss(log_probs, old, adv, mask, clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="advantages"):
        ppo_policy_loss(log_probs, old, torch.zeros(1, 3), mask)
    with pytest.raises(ValueError) as err:
        ppo_policy_loss(log_probs, old, adv, mask, loss_agg_mode="sum")
    assert all(mode in str(err.value) for mode in LOSS_AGG_MODES)


# ------------------------------------------------------------------------- entropy

def test_entropy_from_logits_matches_categorical():
    logits = torch.randn(3, 4, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 30
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy_from_logits(logits), expected, atol=1e-10)


def test_entropy_bonus_aggregates(make_batch):
    b = make_batch(seed=1)
    mask = b["response_mask"]
    bonus, m = entropy_bonus(b["entropy"], mask, loss_agg_mode="seq-mean-token-sum")
    rows = [r for r in range(mask.shape[0]) if mask[r].any()]
    expected = sum(b["entropy"][r][mask[r] != 0].sum().item() for r in rows) / len(rows)
    assert bonus.item() == pytest.approx(expected, rel=1e-12)
    assert m["entropy"].item() == pytest.approx(b["entropy"][mask != 0].mean().item(), rel=1e-12)


# ----------------------------------------------------------------------- value loss

def test_clipped_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0, 3.0, 0.5]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    returns = torch.tensor([[2.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = clipped_value_loss(values, old, returns, mask, cliprange_value=0.2)
    # token 0: V=1 -> clip 0.7; max((1-2)^2, (0.7-2)^2) = 1.69 (clipped branch wins)
    # token 1: V=0 -> clip 0.3; max(0, 0.09) = 0.09 (clipped) ; token 2: V=3 -> 0.7; max(9, .49) = 9
    assert loss.item() == pytest.approx(0.5 * (1.69 + 0.09 + 9.0) / 3)
    assert m["vf_clipfrac"].item() == pytest.approx(2 / 3)
    assert m["vpred_mean"].item() == pytest.approx(4 / 3)
    loss.backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.0, 3.0 / 3, 0.0])
    plain, m2 = clipped_value_loss(values, old, returns, mask, cliprange_value=None)
    assert plain.item() == pytest.approx(0.5 * (1 + 0 + 9) / 3) and m2["vf_clipfrac"].item() == 0


def test_value_loss_explained_variance_and_errors():
    returns = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    loss, m = clipped_value_loss(returns.clone(), returns, returns, torch.ones(1, 4), cliprange_value=0.5)
    assert loss.item() == 0 and m["vf_explained_var"].item() == pytest.approx(1.0)
    _, m = clipped_value_loss(torch.zeros(1, 4), returns, returns, torch.ones(1, 4), cliprange_value=None)
    assert m["vf_explained_var"].item() == pytest.approx(0.0)  # residual = returns
    with pytest.raises(ValueError, match="returns"):
        clipped_value_loss(torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 3), torch.ones(1, 4),
                           cliprange_value=0.2)
    with pytest.raises(ValueError, match="cliprange_value"):
        clipped_value_loss(torch.zeros(1, 4), torch.zeros(1, 4), torch.zeros(1, 4), torch.ones(1, 4),
                           cliprange_value=-1.0)
