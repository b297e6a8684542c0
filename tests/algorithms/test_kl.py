"""KL estimators (values, gradients, straight-through), controllers, penalty and loss."""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.algorithms import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    aggregate_loss,
    apply_kl_penalty,
    build_kl_controller,
    kl_loss,
    kl_penalty,
)

X = [-2.0, -0.3, 0.0, 0.4, 1.5]  # log pi - log pi_ref
BY_HAND = {
    "k1": lambda x: x,
    "abs": abs,
    "k2": lambda x: 0.5 * x * x,
    "mse": lambda x: 0.5 * x * x,
    "k3": lambda x: math.exp(-x) - 1 + x,
    "low_var_kl": lambda x: math.exp(-x) - 1 + x,
}
GRAD_BY_HAND = {  # d estimator / d log_probs
    "k1": lambda x: 1.0,
    "abs": lambda x: math.copysign(1.0, x) if x else 0.0,
    "k2": lambda x: x,
    "k3": lambda x: 1 - math.exp(-x),
}


def _leaf(values):
    ref = torch.tensor([[-1.0] * len(values)], dtype=torch.float64)
    log_probs = (ref + torch.tensor([values], dtype=torch.float64)).requires_grad_()
    return log_probs, ref


@pytest.mark.parametrize("kind", sorted(BY_HAND))
def test_estimator_values_by_hand(kind):
    log_probs, ref = _leaf(X)
    got = kl_penalty(log_probs, ref, kind)[0].tolist()
    assert got == pytest.approx([BY_HAND[kind](x) for x in X], rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("kind", sorted(GRAD_BY_HAND))
def test_estimator_gradients_by_hand(kind):
    log_probs, ref = _leaf(X)
    kl_penalty(log_probs, ref, kind).sum().backward()
    assert log_probs.grad[0].tolist() == pytest.approx([GRAD_BY_HAND[kind](x) for x in X], abs=1e-12)


@pytest.mark.parametrize("base", ["k1", "abs", "k3", "low_var_kl"])
def test_straight_through_value_of_base_gradient_of_k2(base):
    log_probs, ref = _leaf(X)
    value = kl_penalty(log_probs, ref, base + "+")
    assert value[0].tolist() == pytest.approx([BY_HAND[base](x) for x in X], abs=1e-12)
    value.sum().backward()
    assert log_probs.grad[0].tolist() == pytest.approx(X, abs=1e-12)


def test_k3_is_clamped_and_finite():
    log_probs, ref = _leaf([-50.0, 50.0])
    out = kl_penalty(log_probs, ref, "k3")
    assert out[0, 0].item() == 10.0  # exp(50) clamped
    assert out[0, 1].item() == 10.0  # 50 - 1 + exp(-50), clamped
    out.sum().backward()
    assert torch.isfinite(log_probs.grad).all()


def test_k1_and_k3_are_unbiased_monte_carlo():
    torch.manual_seed(0)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    true_kl = float((p * (p / q).log()).sum())
    tokens = torch.multinomial(p, 200_000, replacement=True)
    log_p, log_q = p.log()[tokens].unsqueeze(0), q.log()[tokens].unsqueeze(0)
    for kind in ("k1", "k3"):
        assert kl_penalty(log_p, log_q, kind).mean().item() == pytest.approx(true_kl, abs=4e-3)


# ------------------------------------------------------------------------ controllers

def test_adaptive_controller_ziegler_update_by_hand():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10_000)
    ctl.update(current_kl=9.0, n_steps=256)  # error 0.5 -> clipped 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10_000))
    before = ctl.value
    ctl.update(current_kl=6.0, n_steps=256)  # on target
    assert ctl.value == pytest.approx(before)
    ctl.update(current_kl=5.4, n_steps=100)  # error -0.1, inside the clip
    assert ctl.value == pytest.approx(before * (1 - 0.1 * 100 / 10_000))
    restored = AdaptiveKLController(0.5, 6.0, 10_000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


def test_fixed_controller_and_builder():
    ctl = build_kl_controller("fixed", kl_coef=0.05)
    ctl.update(100.0, 10)
    assert isinstance(ctl, FixedKLController) and ctl.value == 0.05
    assert isinstance(build_kl_controller("adaptive", kl_coef=0.1, target_kl=1, horizon=10), AdaptiveKLController)
    with pytest.raises(ValueError, match="target_kl and horizon"):
        build_kl_controller("adaptive", kl_coef=0.1)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        build_kl_controller("pid", kl_coef=0.1)
    with pytest.raises(ValueError, match="horizon"):
        AdaptiveKLController(0.1, 1.0, 0)


# ------------------------------------------------------------------- penalty / loss

def test_apply_kl_penalty_by_hand():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0], [3.0, 0.0, 0.0]])
    ref = torch.zeros(3, 3)
    log_probs = torch.tensor([[0.1, 0.2, 0.3], [0.4, -0.2, float("nan")], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    rewards, metrics = apply_kl_penalty(scores, log_probs, ref, mask, kl_coef=0.5, kind="k1")
    expected = torch.tensor([[-0.05, -0.1, 1 - 0.15], [-0.2, 2.1, 0.0], [3.0, 0.0, 0.0]])
    assert torch.allclose(rewards, expected)
    # per-sequence means 0.2 and 0.1; the empty row is not counted
    assert metrics["kl"] == pytest.approx(0.15)
    assert metrics["kl_coef"] == 0.5


def test_kl_loss_aggregates_estimator_with_gradient(make_batch):
    batch = make_batch(seed=2)
    log_probs = batch["log_probs"].clone().requires_grad_()
    loss, metrics = kl_loss(log_probs, batch["ref_log_probs"], batch["response_mask"], kind="low_var_kl",
                            loss_agg_mode="seq-mean-token-mean")
    mask = batch["response_mask"]
    per_seq = []
    for row in range(mask.shape[0]):
        xs = [(log_probs[row, t] - batch["ref_log_probs"][row, t]).item() for t in range(mask.shape[1]) if mask[row, t]]
        if xs:
            per_seq.append(sum(math.exp(-x) - 1 + x for x in xs) / len(xs))
    assert loss.item() == pytest.approx(sum(per_seq) / len(per_seq), rel=1e-12)
    loss.backward()
    assert torch.isfinite(log_probs.grad).all()
    assert torch.count_nonzero(log_probs.grad[mask == 0]) == 0
    token_mean = aggregate_loss(kl_penalty(batch["log_probs"], batch["ref_log_probs"], "k3"), mask, "token-mean")
    assert metrics["kl_loss"].item() == pytest.approx(token_mean.item(), rel=1e-12)


def test_kl_bad_input():
    with pytest.raises(ValueError) as err:
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "full")
    assert all(kind in str(err.value) for kind in KL_KINDS)
    with pytest.raises(ValueError, match="ref_log_probs"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 3), "k1")
    with pytest.raises(ValueError, match="response_mask"):
        apply_kl_penalty(torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(2, 2), torch.ones(2, 3), 0.1)
