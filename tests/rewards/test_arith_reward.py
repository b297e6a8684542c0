"""Arithmetic reward: exact match, shaping, and a non-zero graded reward for a random policy."""
import random

import pytest

from megaflow.data.arith import ARITH_VOCAB
from megaflow.rewards import compute_score, get_reward_spec
from megaflow.rewards.arith import parse_arith_response


@pytest.mark.parametrize("response,expected", [
    ("19<eos>", 19), (" 7 <eos>", 7), ("0<eos><eos><eos>", 0), ("19<eos>5", 19),
    ("19", None), ("<eos>", None), ("1+2<eos>", None), ("<bos>3<eos>", None), ("-4<eos>", -4),
])
def test_parse(response, expected):
    assert parse_arith_response(response) == expected


def test_score_table():
    score = lambda r, gt="19": compute_score("arith", r, gt)  # noqa: E731
    assert score("19<eos>") == {"score": 1.0, "acc": 1.0, "format": 1.0}
    assert score("19") == {"score": 0.0, "acc": 0.0, "format": 0.0}  # unterminated
    assert score("1=9<eos>") == {"score": 0.0, "acc": 0.0, "format": 0.0}
    # wrong but well formed: 0.1 + 0.4 / (1 + |pred - answer|)
    assert score("18<eos>")["score"] == pytest.approx(0.1 + 0.4 / 2)
    assert score("9<eos>")["score"] == pytest.approx(0.1 + 0.4 / 11)
    assert score("20<eos>")["score"] == pytest.approx(0.3)
    assert score("9999<eos>")["score"] == pytest.approx(0.1 + 0.4 / 9981)
    custom = compute_score("arith", "18<eos>", "19", format_score=0.2, closeness_weight=0.0)
    assert custom["score"] == pytest.approx(0.2)


def test_registry_keeps_special_tokens_for_arith():
    assert get_reward_spec("arith").skip_special_tokens is False
    assert get_reward_spec("openai/gsm8k").skip_special_tokens is True


def test_errors():
    with pytest.raises(ValueError, match="arith ground truth is not an integer: 'x'"):
        compute_score("arith", "1<eos>", "x")
    with pytest.raises(ValueError, match="format_score \\+ closeness_weight must be < 1"):
        compute_score("arith", "1<eos>", "1", format_score=0.5, closeness_weight=0.5)


def test_random_policy_gets_a_small_graded_reward():
    """Uniform tokens over the 16-token vocabulary, responses of at most 4 tokens.

    Well formed = k digits then EOS (k = 1..3): P = sum_k (10/16)^k * (1/16) = 0.0787;
    each scores 0.1..0.5 (0.1 + 0.4/(1+d)), so the mean lies in [0.1 P, 0.5 P].
    """
    rng = random.Random(0)
    p_well_formed = sum((10 / 16) ** k / 16 for k in (1, 2, 3))
    num = 20000
    scores = []
    for _ in range(num):
        a, b = rng.randint(0, 4), rng.randint(0, 4)
        tokens = []
        for _ in range(4):
            tokens.append(rng.choice(ARITH_VOCAB))
            if tokens[-1] == "<eos>":
                break
        scores.append(compute_score("arith", "".join(tokens), str(a + b))["score"])
    frac_nonzero = sum(s > 0 for s in scores) / num
    mean = sum(scores) / num
    assert abs(frac_nonzero - p_well_formed) < 4 * (p_well_formed / num) ** 0.5
    assert 0.1 * p_well_formed < mean < 0.5 * p_well_formed
    assert len({round(s, 6) for s in scores if s > 0}) > 3  # graded, not binary
