"""GSM8K scorer on the real answers of the project copy and on tricky formats."""
import json
from decimal import Decimal

import pytest

from megaflow.data.gsm8k_layout import GSM8K_DEFAULT_DIR
from megaflow.rewards import compute_score
from megaflow.rewards.gsm8k import extract_answer, normalize_number, parse_ground_truth


@pytest.fixture(scope="module")
def gsm8k_answers():
    out = []
    for split in ("train", "test"):
        for line in (GSM8K_DEFAULT_DIR / f"{split}.jsonl").read_text().splitlines():
            out.append(json.loads(line)["answer"])
    return out


def _label(answer):
    """Independent label: the text after the last '####' without thousands separators."""
    return answer.rsplit("####", 1)[1].strip().replace(",", "")


def test_every_reference_answer_scores_one_and_a_wrong_number_zero(gsm8k_answers):
    assert len(gsm8k_answers) == 7473 + 1319
    for answer in gsm8k_answers:
        label = _label(answer)
        for method in ("strict", "flexible"):
            assert compute_score("openai/gsm8k", answer, label, method=method) == {"score": 1.0, "acc": 1.0}
        wrong = answer.rsplit("####", 1)[0] + f"#### {int(label) + 1}"
        assert compute_score("openai/gsm8k", wrong, label)["score"] == 0.0
        assert parse_ground_truth(answer) == label


@pytest.mark.parametrize("response,expected", [
    ("so the total is\n#### 72", "72"),
    ("#### 1,080", "1080"),
    ("#### $1,234.50.", "1234.5"),
    ("#### $ 18", "18"),
    ("####72", "72"),
    ("####    72 clips", "72"),
    ("#### **72**", "72"),
    ("#### 72.00", "72"),
    ("#### -7", "-7"),
    ("#### 5\nwait, no\n#### 6", "6"),  # the last final-answer line counts
    ("#### 3, 4", "3"),  # "3, 4" is not a thousands-grouped number
    ("the answer is 72", None),  # strict needs ####
    ("####", None),
    ("", None),
])
def test_strict_extraction(response, expected):
    assert extract_answer(response, "strict") == expected


@pytest.mark.parametrize("response,expected", [
    ("the answer is 72.", "72"),
    ("first 3 then 1,200 dollars", "1200"),
    ("#### 5 and then 8", "8"),
    ("costs $0.50", "0.5"),
    ("no numbers here.", None),
])
def test_flexible_extraction(response, expected):
    assert extract_answer(response, "flexible") == expected


@pytest.mark.parametrize("text,expected", [
    ("1,000", "1000"), ("$5.", "5"), (" -0 ", "0"), ("2.50", "2.5"), ("abc", None), ("", None), ("1e3", "1000"),
])
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected
    if expected is not None:
        assert Decimal(expected) == Decimal(text.strip().replace("$", "").replace(",", "").rstrip(".").strip())


def test_scores_and_format_credit():
    assert compute_score("gsm8k", "#### 1,080", "1080") == {"score": 1.0, "acc": 1.0}
    assert compute_score("gsm8k", "#### 1080", "1,080")["score"] == 1.0  # unnormalised label
    assert compute_score("gsm8k", "#### 17", "18", format_score=0.1) == {"score": 0.1, "acc": 0.0}
    assert compute_score("gsm8k", "it is 18", "18", format_score=0.1) == {"score": 0.0, "acc": 0.0}
    assert compute_score("gsm8k", "it is 18", "18", method="flexible")["score"] == 1.0


def test_errors():
    with pytest.raises(ValueError, match="unknown GSM8K extraction method 'loose'"):
        compute_score("gsm8k", "#### 1", "1", method="loose")
    with pytest.raises(ValueError, match="GSM8K ground truth is not a number: 'seven'"):
        compute_score("gsm8k", "#### 7", "seven")
