"""Advantage estimators against hand values and slow per-row / per-group loop references."""
from __future__ import annotations

import statistics

import numpy as np
import pytest
import torch

from megaflow.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages

NAN = float("nan")
OUTCOME_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")


# ------------------------------------------------------------------ loop references

def gae_loop(rewards, values, mask, gamma, lam):
    """Per-row loop over the valid positions only (observation tokens removed)."""
    advantages = torch.zeros_like(rewards)
    for row in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[row, t]]
        running = 0.0
        for k in reversed(range(len(idx))):
            t = idx[k]
            next_value = values[row, idx[k + 1]].item() if k + 1 < len(idx) else 0.0
            delta = rewards[row, t].item() + gamma * next_value - values[row, t].item()
            running = delta + gamma * lam * running
            advantages[row, t] = running
    return advantages


def whiten_ref(x, mask, eps):
    picked = [x[i, j].item() for i in range(x.shape[0]) for j in range(x.shape[1]) if mask[i, j]]
    mean, var = statistics.mean(picked), statistics.variance(picked)
    out = (x - mean) / (var + eps) ** 0.5
    return torch.where(mask != 0, out, torch.zeros_like(out))


def group_loop(scores, lengths, uids, estimator, eps, norm_by_std=True):
    """Per-group loop with the documented rules (empty rows excluded; no signal -> 0)."""
    out = [0.0] * len(scores)
    for uid in set(uids):
        members = [i for i, u in enumerate(uids) if u == uid and lengths[i] > 0]
        group = [scores[i] for i in members]
        if len(group) < 2 or len(set(group)) == 1:
            continue
        mean = statistics.mean(group)
        for i in members:
            if estimator == "rloo":
                out[i] = scores[i] - (sum(group) - scores[i]) / (len(group) - 1)
            elif estimator == "grpo" and norm_by_std:
                out[i] = (scores[i] - mean) / (statistics.stdev(group) + eps)
            else:
                out[i] = scores[i] - mean
    return out


def outcome_batch(seed: int):
    """12 rows, 5 groups: normal, singleton, constant, with an empty response, all empty."""
    g = torch.Generator().manual_seed(seed)
    uids = np.array(["a", "a", "a", "b", "c", "c", "c", "d", "d", "d", "e", "e"], dtype=object)
    lengths = [3, 5, 1, 4, 2, 2, 6, 3, 0, 4, 0, 0]
    mask = torch.zeros(12, 6, dtype=torch.float64)
    rewards = torch.full((12, 6), NAN, dtype=torch.float64)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
        rewards[row, :n] = 0.0
        if n:
            rewards[row, n - 1] = float(torch.randint(0, 3, (1,), generator=g))
    for row in (4, 5, 6):  # constant group c: every score 0.7
        rewards[row, lengths[row] - 1] = 0.7
    rewards[0, 0] = 0.5  # a score spread over two tokens
    return rewards, mask, uids, lengths


# ------------------------------------------------------------------------------ GAE

def test_gae_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = compute_advantages("gae", token_level_rewards=rewards, response_mask=torch.ones(1, 3),
                                  values=values, norm_by_std=False)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.4, 0.3]]))
    assert torch.allclose(ret, torch.ones(1, 3))
    # gamma = 0.5, lam = 0.5: deltas [0.5*0.6-0.5, 0.5*0.7-0.6, 1-0.7] = [-0.2, -0.25, 0.3]
    adv, ret = compute_advantages("gae", token_level_rewards=rewards, response_mask=torch.ones(1, 3),
                                  values=values, gamma=0.5, lam=0.5, norm_by_std=False)
    a2 = 0.3
    a1 = -0.25 + 0.25 * a2
    a0 = -0.2 + 0.25 * a1
    assert torch.allclose(adv, torch.tensor([[a0, a1, a2]]))
    assert torch.allclose(ret, adv + values)


def test_gae_matches_loop_with_gaps_and_empty_rows(make_batch):
    batch = make_batch(seed=1, batch=8, length=9)
    mask = batch["response_mask"]
    rewards = batch["advantages"]  # any numbers with NaN at masked positions
    values = batch["values"]
    adv, ret = compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, values=values,
                                  gamma=0.9, lam=0.8, norm_by_std=False)
    ref = gae_loop(rewards, values, mask, 0.9, 0.8)
    assert torch.allclose(adv, ref, atol=1e-12)
    assert torch.allclose(ret, torch.where(mask != 0, ref + values, torch.zeros_like(ref)), atol=1e-12)
    assert not torch.isnan(adv).any() and not torch.isnan(ret).any()

    whitened, ret2 = compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, values=values,
                                        gamma=0.9, lam=0.8, epsilon=1e-6)
    assert torch.allclose(whitened, whiten_ref(ref, mask, 1e-6), atol=1e-10)
    assert torch.equal(ret2, ret)


def test_observation_tokens_neither_get_advantage_nor_break_the_chain():
    # multi-turn row: [a a obs obs a] must equal the compact row [a a a]
    rewards = torch.tensor([[0.1, 0.2, 9.0, 9.0, 1.0]])
    values = torch.tensor([[0.3, 0.4, NAN, NAN, 0.6]])
    mask = torch.tensor([[1, 1, 0, 0, 1]])
    adv, ret = compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, values=values,
                                  gamma=0.9, lam=0.7, norm_by_std=False)
    compact_adv, compact_ret = compute_advantages(
        "gae", token_level_rewards=torch.tensor([[0.1, 0.2, 1.0]]), response_mask=torch.ones(1, 3),
        values=torch.tensor([[0.3, 0.4, 0.6]]), gamma=0.9, lam=0.7, norm_by_std=False)
    assert torch.allclose(adv[:, [0, 1, 4]], compact_adv)
    assert torch.allclose(ret[:, [0, 1, 4]], compact_ret)
    assert adv[0, 2] == 0 and adv[0, 3] == 0 and ret[0, 2] == 0
    # REINFORCE++ and ReMax returns skip the gap too
    for name, extra in (("reinforce_plus_plus", {}), ("remax", {"baseline_rewards": torch.tensor([0.25])})):
        _, r = compute_advantages(name, token_level_rewards=rewards, response_mask=mask, gamma=0.5,
                                  norm_by_std=False, **extra)
        assert torch.allclose(r, torch.tensor([[0.1 + 0.5 * 0.2 + 0.25 * 1.0, 0.2 + 0.5 * 1.0, 0, 0, 1.0]]))


# ------------------------------------------------------------------ outcome estimators

# estimator -> (loop rule, norm_by_std passed and used by the loop)
LOOP_RULES = {
    "grpo": ("grpo", True),
    "dr_grpo": ("centre", True),  # norm_by_std=True is ignored by Dr. GRPO
    "rloo": ("rloo", True),
    "reinforce_plus_plus_baseline": ("centre", False),  # un-whitened, to compare per group
}


@pytest.mark.parametrize("estimator", OUTCOME_ESTIMATORS)
def test_outcome_estimators_match_group_loop(estimator):
    rewards, mask, uids, lengths = outcome_batch(seed=5)
    rule, norm_by_std = LOOP_RULES[estimator]
    adv, ret = compute_advantages(estimator, token_level_rewards=rewards, response_mask=mask,
                                  group_ids=uids, norm_by_std=norm_by_std, epsilon=1e-6)
    scores = [float(torch.nansum(rewards[i] * mask[i])) for i in range(12)]
    per_row = group_loop(scores, lengths, list(uids), rule, 1e-6, norm_by_std=norm_by_std)
    expected = torch.tensor(per_row, dtype=torch.float64).unsqueeze(-1) * mask
    assert torch.allclose(adv, expected, atol=1e-12)
    assert not torch.isnan(adv).any()
    # singleton b, constant c, empty rows and the all-empty group e: exactly zero
    for row in (3, 4, 5, 6, 8, 10, 11):
        assert torch.count_nonzero(adv[row]) == 0
    assert torch.equal(ret, adv)


def test_grpo_hand_values():
    rewards = torch.zeros(4, 2)
    rewards[:, 1] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv, _ = compute_advantages("grpo", token_level_rewards=rewards, response_mask=torch.ones(4, 2),
                                group_ids=["q"] * 4, epsilon=0.0)
    # mean 0.5, unbiased std = sqrt(1/3)
    expected = 0.5 / (1.0 / 3.0) ** 0.5
    assert torch.allclose(adv[:, 0], torch.tensor([expected, -expected, -expected, expected]))
    adv_dr, _ = compute_advantages("dr_grpo", token_level_rewards=rewards, response_mask=torch.ones(4, 2),
                                   group_ids=["q"] * 4, norm_by_std=True)
    assert torch.allclose(adv_dr[:, 1], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    adv_rloo, _ = compute_advantages("rloo", token_level_rewards=rewards, response_mask=torch.ones(4, 2),
                                     group_ids=["q"] * 4)
    assert torch.allclose(adv_rloo[:, 1], torch.tensor([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3]))


def test_constant_group_is_exactly_zero_despite_rounding():
    rewards = torch.zeros(3, 1)
    rewards[:, 0] = 0.1  # mean of three 0.1 is not exactly 0.1 in float32
    adv, _ = compute_advantages("grpo", token_level_rewards=rewards, response_mask=torch.ones(3, 1),
                                group_ids=[7, 7, 7], epsilon=1e-6)
    assert torch.count_nonzero(adv) == 0


@pytest.mark.parametrize("estimator", OUTCOME_ESTIMATORS)
def test_empty_response_does_not_change_siblings(estimator):
    rewards, mask, uids, _ = outcome_batch(seed=9)
    keep = [i for i in range(12) if i != 8]  # row 8 is the empty sibling in group d
    full, _ = compute_advantages(estimator, token_level_rewards=rewards, response_mask=mask, group_ids=uids,
                                 norm_by_std=True)
    without, _ = compute_advantages(estimator, token_level_rewards=rewards[keep], response_mask=mask[keep],
                                    group_ids=uids[keep], norm_by_std=True)
    assert torch.allclose(full[keep], without, atol=1e-12)
    assert torch.count_nonzero(full[8]) == 0


def test_group_ids_forms_and_permutation_equivariance():
    rewards, mask, uids, _ = outcome_batch(seed=2)
    base, _ = compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_ids=uids)
    as_list, _ = compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_ids=list(uids))
    codes = torch.tensor([ord(u) for u in uids])
    as_tensor, _ = compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_ids=codes)
    assert torch.equal(base, as_list) and torch.equal(base, as_tensor)
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(0))
    permuted, _ = compute_advantages("grpo", token_level_rewards=rewards[perm], response_mask=mask[perm],
                                     group_ids=uids[perm.numpy()])
    assert torch.allclose(permuted, base[perm], atol=1e-12)


# --------------------------------------------------------------- REINFORCE++ / ReMax

def test_reinforce_plus_plus_returns_and_whitening(make_batch):
    batch = make_batch(seed=4)
    mask, rewards = batch["response_mask"], batch["advantages"]
    adv, ret = compute_advantages("reinforce_plus_plus", token_level_rewards=rewards, response_mask=mask,
                                  gamma=0.95, epsilon=1e-8)
    ref_returns = gae_loop(rewards, torch.zeros_like(rewards), mask, 0.95, 1.0)
    assert torch.allclose(ret, ref_returns, atol=1e-12)
    assert torch.allclose(adv, whiten_ref(ref_returns, mask, 1e-8), atol=1e-9)


def test_reinforce_plus_plus_baseline_whitens_centred_scores():
    rewards, mask, uids, lengths = outcome_batch(seed=5)
    adv, centred = compute_advantages("reinforce_plus_plus_baseline", token_level_rewards=rewards,
                                      response_mask=mask, group_ids=uids, epsilon=1e-8)
    assert torch.allclose(adv, whiten_ref(centred, mask, 1e-8), atol=1e-10)


def test_remax_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, NAN]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = compute_advantages("remax", token_level_rewards=rewards, response_mask=mask,
                                  baseline_rewards=torch.tensor([0.25, 1.0]))
    assert torch.allclose(ret, torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]))
    assert torch.allclose(adv, torch.tensor([[0.75, 0.75, 0.75], [-0.5, -0.5, 0.0]]))


# ---------------------------------------------------------------------- contract/errors

def test_registry_and_uniform_signature():
    assert set(ADVANTAGE_ESTIMATORS) == {"gae", "grpo", "dr_grpo", "rloo", "reinforce_plus_plus",
                                         "reinforce_plus_plus_baseline", "remax"}
    assert ADVANTAGE_ESTIMATORS["gae"].requires == ("values",)
    rewards, mask, uids, _ = outcome_batch(seed=1)
    everything = dict(token_level_rewards=rewards, response_mask=mask, values=torch.zeros_like(rewards),
                      group_ids=uids, baseline_rewards=torch.zeros(12), gamma=1.0, lam=0.95)
    for name in ADVANTAGE_ESTIMATORS:
        adv, ret = compute_advantages(name, **everything)
        assert adv.shape == ret.shape == rewards.shape
        assert not adv.requires_grad and not torch.isnan(adv).any() and not torch.isnan(ret).any()
        assert torch.count_nonzero(adv[mask == 0]) == 0


def test_bad_inputs_raise_clear_errors():
    rewards, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError) as err:
        compute_advantages("ppo", token_level_rewards=rewards, response_mask=mask)
    for name in ADVANTAGE_ESTIMATORS:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="'gae' requires 'values'"):
        compute_advantages("gae", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="'grpo' requires 'group_ids'"):
        compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="'remax' requires 'baseline_rewards'"):
        compute_advantages("remax", token_level_rewards=rewards, response_mask=mask)
    with pytest.raises(ValueError, match="response_mask"):
        compute_advantages("grpo", token_level_rewards=rewards, response_mask=torch.ones(2, 4), group_ids=[1, 2])
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, values=torch.zeros(3, 3))
    with pytest.raises(ValueError, match="group_ids"):
        compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_ids=["a"])
    with pytest.raises(ValueError, match="baseline_rewards"):
        compute_advantages("remax", token_level_rewards=rewards, response_mask=mask, baseline_rewards=torch.zeros(3))
    with pytest.raises(ValueError, match="gamma"):
        compute_advantages("gae", token_level_rewards=rewards, response_mask=mask, values=rewards, gamma=1.5)
    unhashable = np.empty(2, dtype=object)
    unhashable[0], unhashable[1] = [1], [2]
    with pytest.raises(TypeError, match="hashable"):
        compute_advantages("grpo", token_level_rewards=rewards, response_mask=mask, group_ids=unhashable)
