"""``rollout.verify_sync``'s tolerance by dtype: fp32 as before, bf16/fp16 from the recorded
calibration, and the split-placement check applying the run's dtype (no processes)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megaflow.protocol import DataProto
from megaflow.rollout import verify_sync as V


def test_tolerances_follow_their_calibration():
    assert V.verify_sync_tolerance("float32") == 1e-5
    for dtype, stats in (("bfloat16", V.BF16_CALIBRATION), ("float16", V.FP16_CALIBRATION)):
        tolerance = V.verify_sync_tolerance(dtype)
        assert stats["p99"] <= stats["max"] < tolerance and stats["tokens"] >= 512
        assert tolerance == pytest.approx(V.round_up_one_digit(2 * stats["max"]))
    assert V.verify_sync_tolerance("bfloat16") > V.verify_sync_tolerance("float16") > 1e-5
    with pytest.raises(ValueError, match="no tolerance for model.dtype='int8'"):
        V.verify_sync_tolerance("int8")


def test_round_up_one_digit():
    assert [V.round_up_one_digit(x) for x in (0.0123, 0.02, 0.0991, 3.1e-4)] == pytest.approx([0.02, 0.02, 0.1, 4e-4])


def test_gap_statistics_by_numpy():
    gaps = torch.arange(200, dtype=torch.float32).reshape(4, 50) / 1000
    ref = gaps.numpy().reshape(-1).astype(np.float64)
    stats = V.gap_statistics(gaps)
    assert stats["tokens"] == 200 and math.isclose(stats["max"], ref.max(), rel_tol=1e-6)
    assert math.isclose(stats["mean"], ref.mean(), rel_tol=1e-6)
    assert math.isclose(stats["p99"], np.percentile(ref, 99), rel_tol=1e-6)


class _Group:
    def __init__(self, proto: DataProto) -> None:
        self.proto = proto

    def probe_rollout(self) -> list[DataProto]:
        return [self.proto]

    def compute_log_prob(self, data: DataProto) -> DataProto:
        return self.proto


def test_split_check_uses_the_runs_dtype():
    """A probe gap of 0.004 nats: a failure in fp32, within bf16's calibrated tolerance."""
    from megaflow.trainer.rollout_source import verify_split_sync

    ones = torch.ones(2, 3, dtype=torch.long)
    engine = torch.full((2, 3), -1.0)
    proto = DataProto.from_dict({"prompts": ones, "responses": ones, "input_ids": ones, "attention_mask": ones,
                                 "position_ids": ones, "response_mask": ones, "rollout_log_probs": engine,
                                 "old_log_probs": engine + torch.tensor([0.0, 0.004, 0.0])})
    group = _Group(proto)
    assert verify_split_sync(group, group, "bfloat16") == pytest.approx(0.004, rel=1e-3)
    with pytest.raises(RuntimeError, match=r"up to 0\.004 \(tolerance 1e-05 for float32\)"):
        verify_split_sync(group, group, "float32")
