"""Countdown scorer, format rewards and the data-source registry."""
import pytest

from megaflow.rewards import (
    compute_score, format_reward, known_data_sources, register_reward, unregister_reward, with_format_reward,
)
from megaflow.rewards.countdown import evaluate_equation
from megaflow.rewards.format import GSM8K_ANSWER_PATTERN

GT = {"target": 24, "numbers": [4, 6, 1]}


@pytest.mark.parametrize("response,score", [
    ("<think>...</think><answer>4 * 6 * 1</answer>", 1.0),
    ("<answer>(6 - 1 - 1) * 6</answer>", 0.1),  # wrong numbers
    ("<answer>4 * 6 + 1</answer>", 0.1),  # right numbers, wrong value
    ("<answer>4 * 6 / (1 - 1)</answer>", 0.1),  # 1 used twice
    ("<answer>__import__('os')</answer>", 0.1),
    ("<answer>1</answer> then <answer>6*4/1</answer>", 1.0),  # last answer counts
    ("4 * 6 * 1", 0.0),
])
def test_countdown(response, score):
    assert compute_score("countdown", response, GT)["score"] == score


def test_safe_evaluation():
    assert evaluate_equation("(1 + 2) * -3 / 4") == pytest.approx(-2.25)
    assert evaluate_equation("2 ** 3") is None
    assert evaluate_equation("1 / 0") is None
    assert evaluate_equation("abs(1)") is None
    with pytest.raises(ValueError, match="countdown ground truth must be"):
        compute_score("countdown", "<answer>1</answer>", {"numbers": [1]})


def test_format_reward():
    assert format_reward("<think>a\nb</think>\n<answer>7</answer>") == 1.0
    assert format_reward("<answer>7</answer>") == 0.0
    assert format_reward("steps...\n#### 1,080.", GSM8K_ANSWER_PATTERN) == 1.0
    assert format_reward("#### 72 and more text", GSM8K_ANSWER_PATTERN) == 0.0
    with pytest.raises(ValueError, match="invalid format pattern"):
        format_reward("x", "(")


def test_with_format_reward_combines_scores():
    scorer = with_format_reward(lambda s, gt, extra=None: float(gt in s), r"<answer>.*</answer>", format_weight=0.2)
    assert scorer("<answer>5</answer>", "5") == {"score": 1.0, "format": 1.0}
    assert scorer("5", "5") == {"score": pytest.approx(0.8), "format": 0.0}
    assert scorer("<answer>4</answer>", "5") == {"score": pytest.approx(0.2), "format": 1.0}
    with pytest.raises(ValueError, match="format_weight must be in"):
        with_format_reward(lambda *a: 0.0, "x", format_weight=2.0)


def test_registry():
    assert {"arith", "countdown", "gsm8k", "openai/gsm8k"} <= set(known_data_sources())
    with pytest.raises(ValueError, match=r"no rule reward registered for data_source 'nope'; known data "
                                         r"sources: .*arith.*countdown.*openai/gsm8k"):
        compute_score("nope", "x", "y")

    @register_reward("test/echo")
    def echo(solution_str, ground_truth, extra_info=None, bonus=0.0):
        return float(solution_str == ground_truth) + bonus

    try:
        assert compute_score("test/echo", "a", "a", bonus=0.5) == 1.5
        with pytest.raises(ValueError, match="already have a reward"):
            register_reward("test/echo")(echo)
        register_reward("test/echo", override=True)(lambda *a, **k: 0.25)
        assert compute_score("test/echo", "a", "a") == 0.25
    finally:
        unregister_reward("test/echo")
    assert "test/echo" not in known_data_sources()
