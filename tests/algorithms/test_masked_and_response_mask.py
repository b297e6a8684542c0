"""Masked statistics and position-based response masks."""
from __future__ import annotations

import statistics

import pytest
import torch

from megaflow.algorithms import (
    compute_response_mask,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
    response_lengths,
)

NAN = float("nan")


def test_masked_mean_sum_by_hand_and_ignores_nan_padding():
    values = torch.tensor([[1.0, 2.0, NAN], [NAN, float("inf"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 1]])
    assert masked_sum(values, mask).item() == 9.0
    assert masked_mean(values, mask).item() == 3.0
    assert torch.equal(masked_mean(values, mask, dim=-1), torch.tensor([1.5, 6.0]))
    assert torch.equal(masked_sum(values, mask.bool(), dim=0), torch.tensor([1.0, 2.0, 6.0]))


def test_degenerate_masks_are_defined():
    values = torch.tensor([[4.0, NAN, NAN]])
    none = torch.zeros(1, 3)
    one = torch.tensor([[1.0, 0.0, 0.0]])
    assert masked_mean(values, none).item() == 0.0
    assert masked_var(values, none).item() == 0.0
    assert masked_mean(values, one).item() == 4.0
    assert masked_var(values, one).item() == 0.0
    assert masked_var(values, one, unbiased=False).item() == 0.0
    assert torch.equal(masked_whiten(values, none), torch.zeros(1, 3))
    assert torch.equal(masked_whiten(values, one), torch.zeros(1, 3))
    assert torch.equal(masked_whiten(values, one, shift_mean=False), torch.tensor([[4.0, 0.0, 0.0]]))
    # per-row reduction with an empty row
    rows = torch.tensor([[1.0, 3.0], [NAN, NAN]])
    assert torch.equal(masked_mean(rows, torch.tensor([[1, 1], [0, 0]]), dim=-1), torch.tensor([2.0, 0.0]))


def test_masked_var_and_whiten_against_statistics_module():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(5, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 6, generator=g) > 0.4).to(torch.float64)
    mask[3] = 0
    picked = [values[i, j].item() for i in range(5) for j in range(6) if mask[i, j]]
    assert masked_var(values, mask).item() == pytest.approx(statistics.variance(picked), rel=1e-12)
    assert masked_var(values, mask, unbiased=False).item() == pytest.approx(statistics.pvariance(picked), rel=1e-12)
    for row in range(5):
        row_vals = [values[row, j].item() for j in range(6) if mask[row, j]]
        expected = statistics.variance(row_vals) if len(row_vals) >= 2 else 0.0
        assert masked_var(values, mask, dim=-1)[row].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)

    whitened = masked_whiten(values, mask, epsilon=0.0)
    mean, std = statistics.mean(picked), statistics.stdev(picked)
    for i in range(5):
        for j in range(6):
            expected = (values[i, j].item() - mean) / std if mask[i, j] else 0.0
            assert whitened[i, j].item() == pytest.approx(expected, rel=1e-10, abs=1e-12)
    scaled = masked_whiten(values, mask, shift_mean=False, epsilon=0.0)
    assert torch.allclose(scaled, torch.where(mask != 0, values / std, torch.zeros_like(values)), rtol=1e-12)


def test_masked_stats_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="mask"):
        masked_mean(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(TypeError, match="values"):
        masked_sum([1.0, 2.0], torch.ones(2))


# ----------------------------------------------------------------------------- masks

def _reference_mask(row: list[int], eos_ids: set[int]) -> list[int]:
    out, ended = [], False
    for token in row:
        out.append(0 if ended else 1)
        ended = ended or token in eos_ids
    return out


def test_pad_equals_eos_keeps_first_eos_only():
    eos = pad = 2
    responses = torch.tensor([[5, 6, eos, pad, pad], [eos, pad, pad, pad, pad], [5, 0, 6, eos, 0]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 0]])
    assert torch.equal(compute_response_mask(responses, eos), expected)
    assert torch.equal(response_lengths(expected), torch.tensor([3, 1, 4]))


def test_no_eos_means_whole_response_is_valid():
    responses = torch.tensor([[3, 4, 5, 6]])
    assert torch.equal(compute_response_mask(responses, [2]), torch.ones(1, 4, dtype=torch.long))


def test_several_eos_ids_first_of_any_ends():
    responses = torch.tensor([[5, 7, 2, 2], [5, 2, 7, 7], [5, 5, 5, 5]])
    mask = compute_response_mask(responses, (7, 2), dtype=torch.bool)
    assert mask.dtype == torch.bool
    assert mask.tolist() == [[True, True, False, False], [True, True, False, False], [True] * 4]
    as_tensor = compute_response_mask(responses, torch.tensor([2, 7]), dtype=torch.float32)
    assert torch.equal(as_tensor, mask.float())


def test_response_mask_matches_loop_reference():
    g = torch.Generator().manual_seed(3)
    responses = torch.randint(0, 6, (32, 9), generator=g)
    mask = compute_response_mask(responses, [0, 4])
    for row in range(32):
        assert mask[row].tolist() == _reference_mask(responses[row].tolist(), {0, 4})


def test_response_mask_bad_input():
    with pytest.raises(TypeError, match="integer"):
        compute_response_mask(torch.zeros(2, 3), 2)
    with pytest.raises(ValueError, match="at least one"):
        compute_response_mask(torch.zeros(2, 3, dtype=torch.long), [])
    with pytest.raises(ValueError, match="responses"):
        compute_response_mask(torch.zeros(3, dtype=torch.long), 2)
    with pytest.raises(TypeError, match="eos_token_ids"):
        compute_response_mask(torch.zeros(2, 3, dtype=torch.long), ["</s>"])
