"""Safe RLHF's PPO-Lagrangian math against hand values and against safe-rlhf's own update
(one SGD step on log lambda with the loss -(J_C - d) exp(log lambda)), Dai et al. 2023."""
from __future__ import annotations

import math

import pytest
import torch

from megaflow.algorithms.safe_rlhf import LagrangeMultiplier, episode_costs, lagrangian_advantages


def test_combined_advantage_by_hand():
    a_r = torch.tensor([[1.0, -2.0, 0.5], [0.0, 4.0, 1.0]])
    a_c = torch.tensor([[0.5, 1.0, -1.0], [2.0, 0.0, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = lagrangian_advantages(a_r, a_c, 3.0, mask)
    # (A_r - 3 A_c) / 4 on valid tokens, 0 on the masked one
    expected = torch.tensor([[(1 - 1.5) / 4, (-2 - 3) / 4, 0.0], [(0 - 6) / 4, 4 / 4, (1 - 9) / 4]])
    assert torch.equal(out, expected)
    assert torch.equal(lagrangian_advantages(a_r, a_c, 0.0), a_r)  # lambda = 0: the reward's advantage


@pytest.mark.parametrize("bad", [(-0.1, "finite and >= 0"), (math.nan, "finite")])
def test_combined_advantage_refuses_a_negative_or_nan_lambda(bad):
    with pytest.raises(ValueError, match=bad[1]):
        lagrangian_advantages(torch.zeros(1, 2), torch.zeros(1, 2), bad[0])
    with pytest.raises(ValueError, match="same"):
        lagrangian_advantages(torch.zeros(1, 2), torch.zeros(1, 3), 1.0)


def test_episode_cost_is_the_row_sum():
    assert torch.equal(episode_costs(torch.tensor([[0.0, 1.0, 0.5], [0.0, 0.0, 0.0]])), torch.tensor([1.5, 0.0]))


def test_dual_ascent_by_hand_and_the_clip():
    m = LagrangeMultiplier(lambda_init=1.0, lr=0.5, cost_limit=0.05)
    assert m.update(0.25) == pytest.approx(math.exp(0.5 * 1.0 * 0.2))  # cost above the limit: lambda rises
    log1 = 0.1
    assert m.log_lambda == pytest.approx(log1)
    m.update(0.0)  # below: lambda falls, by lr * lambda * (0 - d) in log space
    assert m.log_lambda == pytest.approx(log1 + 0.5 * math.exp(log1) * (0.0 - 0.05))
    capped = LagrangeMultiplier(lambda_init=1.0, lr=10.0, cost_limit=0.0, lambda_max=2.0)
    assert capped.update(1.0) == pytest.approx(2.0)  # exp(10) clipped at lambda_max
    assert LagrangeMultiplier(5.0, 0.1, 0.0, lambda_max=2.0).value == pytest.approx(2.0)


def test_dual_ascent_is_safe_rlhfs_sgd_step_on_log_lambda():
    """The closed form equals torch's SGD on the parameter log lambda with safe-rlhf's loss."""
    m = LagrangeMultiplier(lambda_init=0.7, lr=0.3, cost_limit=0.2)
    log_lambda = torch.nn.Parameter(torch.tensor(math.log(0.7), dtype=torch.float64))
    opt = torch.optim.SGD([log_lambda], lr=0.3)
    for cost in (0.9, 0.5, 0.1, 0.0, 0.4):
        opt.zero_grad()
        loss = -(cost - 0.2) * log_lambda.exp()
        loss.backward()
        opt.step()
        assert m.update(cost) == pytest.approx(float(log_lambda.detach().exp()), rel=1e-12)


def test_state_round_trips_exactly_and_refuses_bad_values():
    m = LagrangeMultiplier(1.3, 0.37, 0.1)
    for cost in (0.3, 0.7, 0.01):
        m.update(cost)
    import json

    restored = LagrangeMultiplier(1.0, 0.37, 0.1)
    restored.load_state_dict(json.loads(json.dumps(m.state_dict())))
    assert restored.log_lambda == m.log_lambda  # bit-exact through JSON
    assert restored.update(0.5) == m.update(0.5)
    with pytest.raises(ValueError, match="log_lambda"):
        restored.load_state_dict({"log_lambda": float("inf")})
    for kwargs, name in (({"lambda_init": 0.0}, "lambda_init"), ({"lr": -1.0}, "lr"),
                         ({"lambda_max": 0.0}, "lambda_max")):
        args = {"lambda_init": 1.0, "lr": 0.1, "cost_limit": 0.0, **kwargs}
        with pytest.raises(ValueError, match=name):
            LagrangeMultiplier(**args)
    with pytest.raises(ValueError, match="mean episode cost"):
        m.update(math.nan)
