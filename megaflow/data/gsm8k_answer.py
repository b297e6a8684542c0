"""The GSM8K answer format: the final ``#### <number>`` of a solution, normalised.

GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems") ends every
reference solution with ``#### <number>``. The data preparation reads labels with
:func:`parse_ground_truth`; the rule reward (:mod:`megaflow.rewards.gsm8k`) reads the
policy's answers with :func:`extract_answer`, in one of two modes, as in verl's scorer:

* ``strict``: the number after the last ``####`` (required format);
* ``flexible``: the last number anywhere in the response.

Numbers are compared by value after normalisation, tolerant of thousands separators
(``1,080``), currency signs (``$18``), a trailing period (``72.``), spaces after ``####``,
markdown bold (``#### **72**``) and trailing zeros (``72.00`` == ``72``).
"""
from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

EXTRACTION_METHODS = ("strict", "flexible")

# A number: thousands-grouped ("1,234,567") or plain digits, optional decimals; or ".5".
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
# "####" then optional spaces, markdown bold and a currency sign, then the number.
_STRICT_RE = re.compile(r"####[\s*]*\$?\s*(" + _NUMBER + r")")


def normalize_number(text: str) -> str | None:
    """Canonical decimal string of a number written as in GSM8K answers, or None.

    ``"$1,080.00."`` -> ``"1080"``, ``"-3"`` -> ``"-3"``, ``"0.50"`` -> ``"0.5"``,
    ``"abc"`` -> None. Leading/trailing spaces, ``$`` and one trailing period are ignored.
    """
    cleaned = text.strip().replace("$", "").replace(",", "").strip().rstrip(".").strip()
    if not cleaned:
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    value = value.normalize()
    if value == value.to_integral_value():
        value = value.quantize(Decimal(1))
    text = format(value, "f")
    return "0" if text == "-0" else text


def extract_answer(solution_str: str, method: str = "strict") -> str | None:
    """The normalised final answer of ``solution_str``, or None when there is none.

    Args:
        solution_str: the decoded response.
        method: ``"strict"`` (number after the last ``####``) or ``"flexible"`` (last
            number in the text).

    Raises:
        ValueError: unknown ``method`` (the valid ones are listed).
    """
    if method == "strict":
        matches = _STRICT_RE.findall(solution_str)
    elif method == "flexible":
        matches = _NUMBER_RE.findall(solution_str)
    else:
        raise ValueError(f"unknown GSM8K extraction method {method!r}; expected one of {EXTRACTION_METHODS}")
    return normalize_number(matches[-1]) if matches else None


def parse_ground_truth(answer: str) -> str:
    """The normalised label from a GSM8K ``answer`` field (``"...\\n#### 72"`` -> ``"72"``).

    Raises:
        ValueError: the text has no ``#### <number>`` line.
    """
    label = extract_answer(answer, method="strict")
    if label is None:
        raise ValueError(f"GSM8K answer has no '#### <number>' line: {answer[-120:]!r}")
    return label


__all__ = ["EXTRACTION_METHODS", "normalize_number", "extract_answer", "parse_ground_truth"]
