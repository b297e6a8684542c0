"""Shared fixtures for the algorithm tests: random batches with awkward masks."""
from __future__ import annotations

import pytest
import torch


def _awkward_mask(batch: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """0/1 mask with right padding, observation gaps, an empty row and a 1-token row."""
    mask = torch.zeros(batch, length)
    for row in range(batch):
        n = int(torch.randint(1, length + 1, (1,), generator=generator))
        mask[row, :n] = 1
        if n >= 4 and row % 2 == 0:  # observation/tool tokens inside the response
            start = int(torch.randint(1, n - 2, (1,), generator=generator))
            mask[row, start : start + 2] = 0
    mask[1] = 0  # empty response
    mask[2] = 0
    mask[2, 0] = 1  # single valid token
    return mask


@pytest.fixture
def make_batch():
    """Factory: ``make_batch(seed, batch=8, length=7, dtype=float64) -> dict`` of tensors.

    Keys: log_probs, old_log_probs, ref_log_probs, advantages, values, old_values,
    returns, entropy, response_mask (float 0/1). Log-ratios span far outside any clip
    band; advantages have both signs; masked positions hold NaN in every field except
    the mask, to prove that they are never read.
    """

    def build(seed: int, batch: int = 8, length: int = 7, dtype: torch.dtype = torch.float64) -> dict:
        g = torch.Generator().manual_seed(seed)
        mask = _awkward_mask(batch, length, g)

        def rand(scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
            x = (torch.rand(batch, length, generator=g, dtype=dtype) - 0.5) * 2 * scale + shift
            return torch.where(mask != 0, x, torch.full_like(x, float("nan")))

        old_log_probs = rand(1.0, -2.0)
        return {
            "old_log_probs": old_log_probs,
            "log_probs": old_log_probs + rand(1.5),
            "ref_log_probs": old_log_probs + rand(0.7),
            "advantages": rand(2.0),
            "values": rand(1.0),
            "old_values": rand(1.0),
            "returns": rand(1.5),
            "entropy": rand(0.5, 1.0),
            "response_mask": mask.to(dtype),
        }

    return build
