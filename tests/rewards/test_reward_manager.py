"""RuleRewardManager: decoding by response_mask, score placement, errors with context."""
import math

import numpy as np
import pytest
import torch

from megaflow.data import get_tokenizer
from megaflow.protocol import DataProto
from megaflow.rewards import RewardFunctionError, RuleRewardManager, register_reward, reward_metrics, unregister_reward

TOK = get_tokenizer("arith")
ID = {t: i for i, t in enumerate(TOK.convert_ids_to_tokens(list(range(16))))}
EOS = ID["<eos>"]


def ids(text):
    return [ID[c] for c in text]


def batch(rows, *, data_source="arith", **non_tensors):
    """rows: (token ids, mask) pairs of equal length."""
    responses = torch.tensor([r for r, _ in rows])
    mask = torch.tensor([m for _, m in rows])
    nt = {"data_source": [data_source] * len(rows), **non_tensors}
    return DataProto.from_dict({"responses": responses, "response_mask": mask}, nt)


@pytest.fixture
def recorder():
    """A scorer that records what it was called with and returns len(text)."""
    calls = []

    @register_reward("test/recorder")
    def score(solution_str, ground_truth, extra_info=None, **kwargs):
        calls.append((solution_str, ground_truth, extra_info, kwargs))
        return {"score": float(len(solution_str)), "echo": 1.0}

    yield calls
    unregister_reward("test/recorder")


def test_score_on_last_valid_token_with_pad_equal_eos():
    # pad == eos == 0: "19<eos>" then pads, "3<eos>", a truncated response, an empty row
    rows = [
        (ids("19") + [EOS, EOS, EOS], [1, 1, 1, 0, 0]),
        (ids("3") + [EOS, EOS, EOS, EOS], [1, 1, 0, 0, 0]),
        (ids("12345"), [1, 1, 1, 1, 1]),
        ([EOS] * 5, [0, 0, 0, 0, 0]),
    ]
    data = batch(rows, ground_truth=["19", "4", "12345", "0"])
    out = RuleRewardManager(TOK)(data)
    scores = out.batch["token_level_scores"]
    assert scores.shape == (4, 5) and scores.dtype == torch.float32
    expected_seq = [1.0, 0.1 + 0.4 / 2, 0.0, 0.0]  # exact; off by one; unterminated; empty
    for i, (_, mask) in enumerate(rows):  # reference: loop to the last 1 of the mask
        last = max((j for j, m in enumerate(mask) if m), default=None)
        for j in range(5):
            want = expected_seq[i] if j == last else 0.0
            assert scores[i, j].item() == pytest.approx(want)
    assert [float(x) for x in out.non_tensor_batch["reward_score"]] == pytest.approx(expected_seq)
    assert list(out.non_tensor_batch["reward_acc"]) == [1.0, 0.0, 0.0, 0.0]


def test_only_masked_in_tokens_are_decoded(recorder):
    # tokens outside the mask (after EOS, or an observation span inside) are not text
    rows = [(ids("12") + [EOS] + ids("99"), [1, 1, 1, 0, 0]),
            (ids("1") + ids("23") + ids("4") + [EOS], [1, 0, 0, 1, 1])]
    data = batch(rows, data_source="test/recorder", ground_truth=["a", "b"],
                 extra_info=[{"k": 1}, {"k": 2}])
    out = RuleRewardManager(TOK, reward_kwargs={"test/recorder": {"flag": True}})(data)
    assert [c[0] for c in recorder] == ["12", "14"]  # skip_special_tokens=True by default
    assert [c[1] for c in recorder] == ["a", "b"]
    assert [c[2] for c in recorder] == [{"k": 1}, {"k": 2}]
    assert all(c[3] == {"flag": True} for c in recorder)
    assert out.batch["token_level_scores"][1].tolist() == [0, 0, 0, 0, 2.0]  # last 1 of a holed mask
    assert list(out.non_tensor_batch["reward_echo"]) == [1.0, 1.0]


def test_empty_response_is_scored_on_empty_text(recorder):
    data = batch([([EOS, EOS], [0, 0])], data_source="test/recorder", ground_truth=["x"])
    out = RuleRewardManager(TOK)(data)
    assert recorder[0][0] == "" and out.batch["token_level_scores"].abs().sum() == 0


def test_verl_reward_model_field_and_mixed_sources():
    rows = [(ids("7") + [EOS], [1, 1]), (ids("18"), [1, 1])]
    responses = torch.tensor([r for r, _ in rows])
    mask = torch.tensor([m for _, m in rows])
    data = DataProto.from_dict(
        {"responses": responses, "response_mask": mask},
        {"data_source": ["arith", "gsm8k"],
         "reward_model": [{"style": "rule", "ground_truth": "7"}, {"style": "rule", "ground_truth": "18"}]})
    out = RuleRewardManager(TOK, reward_kwargs={"gsm8k": {"method": "flexible"}})(data)
    assert out.batch["token_level_scores"].tolist() == [[0.0, 1.0], [0.0, 1.0]]
    metrics = reward_metrics(out, data.non_tensor_batch["data_source"])
    assert metrics["reward/score/mean"] == 1.0 and metrics["reward/acc/gsm8k"] == 1.0
    assert "reward/format/gsm8k" not in metrics and metrics["reward/format/arith"] == 1.0
    assert math.isnan(out.non_tensor_batch["reward_format"][1])


def test_raising_scorer_names_source_sample_and_response():
    @register_reward("test/boom")
    def boom(solution_str, ground_truth, extra_info=None):
        if ground_truth == "bad":
            raise KeyError("missing field")
        return 1.0

    try:
        long_response = ids("1234567890") * 3
        rows = [(ids("1") + [EOS] * 29, [1] + [0] * 29), (long_response, [1] * 30)]
        data = batch(rows, data_source="test/boom", ground_truth=["ok", "bad"],
                     index=[41, 42], uid=["u0", "u1"])
        with pytest.raises(RewardFunctionError) as info:
            RuleRewardManager(TOK, max_error_chars=12)(data)
        msg = str(info.value)
        assert "data source 'test/boom' raised KeyError" in msg
        assert "sample 1, index=42, uid='u1'" in msg
        assert "response='123456789012...[truncated]'" in msg
        assert isinstance(info.value.__cause__, KeyError)
    finally:
        unregister_reward("test/boom")


@pytest.mark.parametrize("value,fragment", [
    (float("nan"), "non-finite score nan"),
    ({"acc": 1.0}, "dict without 'score'"),
    ("high", "non-numeric values"),
])
def test_invalid_scores_are_rejected(value, fragment):
    register_reward("test/invalid")(lambda *a, **k: value)
    try:
        with pytest.raises(RewardFunctionError, match=fragment):
            RuleRewardManager(TOK)(batch([([EOS], [1])], data_source="test/invalid", ground_truth=["x"]))
    finally:
        unregister_reward("test/invalid")


def test_input_errors():
    good = batch([([EOS], [1])], ground_truth=["1"])
    with pytest.raises(ValueError, match=r"sample 0: no rule reward registered for data_source 'mystery'"):
        RuleRewardManager(TOK)(batch([([EOS], [1])], data_source="mystery", ground_truth=["1"]))
    with pytest.raises(ValueError, match=r"needs tensor fields \['response_mask'\]"):
        RuleRewardManager(TOK)(good.select(batch_keys=["responses"], non_tensor_keys=["data_source", "ground_truth"]))
    with pytest.raises(ValueError, match="needs non-tensor field 'ground_truth'"):
        RuleRewardManager(TOK)(good.select(batch_keys=["responses", "response_mask"],
                                           non_tensor_keys=["data_source"]))
    bad_shape = DataProto.from_dict({"responses": torch.zeros(1, 3, dtype=torch.long),
                                     "response_mask": torch.ones(1, 2, dtype=torch.long)},
                                    {"data_source": np.array(["arith"], dtype=object), "ground_truth": ["1"]})
    with pytest.raises(ValueError, match=r"responses \[1, 3\] and response_mask \[1, 2\]"):
        RuleRewardManager(TOK)(bad_shape)
