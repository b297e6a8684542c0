"""Safe RLHF's rule cost: contains_digit and the cost manager's token-level costs."""
from __future__ import annotations

import pytest
import torch

from megaflow.config.schema import COST_FUNCTION_RANGES
from megaflow.data.arith import build_arith_tokenizer
from megaflow.protocol import DataProto
from megaflow.rewards import RewardFunctionError
from megaflow.rewards.cost import COST_FUNCTIONS, RuleCostManager, contains_digit


def test_contains_digit_reads_the_answer_before_eos():
    assert contains_digit("19<eos>", digit=9) == {"score": 1.0}
    assert contains_digit("18<eos>9", digit=9) == {"score": 0.0}  # after the EOS: not part of the answer
    assert contains_digit("7", digit=7) == {"score": 1.0}
    with pytest.raises(ValueError, match="0-9"):
        contains_digit("1", digit=10)


def test_every_builtin_cost_has_a_range_at_load():
    assert set(COST_FUNCTIONS) == set(COST_FUNCTION_RANGES)


def _batch(tok, texts, width=4):
    rows, masks = [], []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        rows.append(ids + [tok.pad_token_id] * (width - len(ids)))
        masks.append([1] * len(ids) + [0] * (width - len(ids)))
    return DataProto.from_dict({"responses": torch.tensor(rows), "response_mask": torch.tensor(masks)},
                               {"data_source": ["arith"] * len(texts), "ground_truth": ["0"] * len(texts)})


def test_cost_manager_puts_the_cost_on_the_last_valid_token():
    tok = build_arith_tokenizer()
    out = RuleCostManager(tok, contains_digit, {"digit": 9})(_batch(tok, ["19<eos>", "8<eos>", "99"]))
    expected = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert torch.equal(out.batch["token_level_costs"], expected)
    assert list(out.non_tensor_batch["cost_score"]) == [1.0, 0.0, 1.0]


def test_a_failing_cost_function_is_named():
    tok = build_arith_tokenizer()
    with pytest.raises(RewardFunctionError, match="raised ValueError"):
        RuleCostManager(tok, contains_digit, {"digit": 12})(_batch(tok, ["1<eos>"]))
