"""moe/routing_agreement (megaflow.algorithms.routing_agreement) against a hand count."""
from __future__ import annotations

import pytest
import torch

from megaflow.algorithms import routing_agreement


def test_routing_agreement_counts_equal_expert_sets_on_response_tokens_by_hand():
    # 2 rows, seq 4 (prompt 2, response 2), 2 layers, top-2.
    engine = torch.tensor([
        [[[0, 1], [2, 3]], [[1, 2], [0, 3]], [[0, 1], [1, 2]], [[-1, -1], [-1, -1]]],
        [[[-1, -1], [-1, -1]], [[3, 0], [1, 2]], [[2, 3], [0, 1]], [[3, 1], [2, 0]]],
    ], dtype=torch.int8)
    trainer = torch.tensor([
        [[[3, 2], [1, 0]], [[0, 0], [0, 0]], [[1, 0], [2, 3]], [[0, 1], [1, 2]]],
        [[[0, 1], [0, 1]], [[0, 1], [0, 1]], [[3, 2], [1, 0]], [[1, 3], [3, 0]]],
    ], dtype=torch.int8)
    mask = torch.tensor([[1, 1], [1, 1]])
    # Response positions 2, 3. Row 0: pos 2 layer 0 {0,1}={0,1} yes, layer 1 {1,2}!={2,3} no;
    # pos 3 has no engine routing (last token): not counted. Row 1: pos 2 layer 0 {2,3}={3,2}
    # yes, layer 1 {0,1}={1,0} yes; pos 3 layer 0 {1,3}={1,3} yes, layer 1 {0,2}!={0,3} no.
    assert routing_agreement(engine, trainer, mask) == (4, 6)
    # Masking out row 1's second response token drops its 2 pairs (1 agreeing).
    assert routing_agreement(engine, trainer, torch.tensor([[1, 1], [1, 0]])) == (3, 4)
    # Prompt positions never count, whatever they hold.
    trainer2 = trainer.clone()
    trainer2[:, :2] = 9
    assert routing_agreement(engine, trainer2, mask) == (4, 6)


def test_routing_agreement_refuses_mismatched_shapes():
    a = torch.zeros(2, 4, 2, 2, dtype=torch.int8)
    with pytest.raises(ValueError, match="routings"):
        routing_agreement(a, a[:, :3], torch.ones(2, 2))
    with pytest.raises(ValueError, match="response_mask"):
        routing_agreement(a, a, torch.ones(3, 2))
