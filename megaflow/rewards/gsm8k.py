"""GSM8K rule reward: compare the response's final ``#### <number>`` answer with the label.

GSM8K (Cobbe et al. 2021) ends every reference solution with ``#### <number>``; the prompt
instruction asks the policy to do the same. The answer format and its two extraction modes
(``strict``, ``flexible``, as in verl's ``gsm8k`` scorer) live in
:mod:`megaflow.data.gsm8k_answer`; numbers are compared by value after normalisation.
"""
from __future__ import annotations

from decimal import Decimal
from typing import Any

from megaflow.data.gsm8k_answer import EXTRACTION_METHODS, extract_answer, normalize_number, parse_ground_truth


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> dict[str, float]:
    """Score a GSM8K response against its label.

    Returns ``{"score": s, "acc": a}`` where ``a`` is 1.0 for a correct answer, else 0.0,
    and ``s`` is ``score`` when correct, ``format_score`` when an answer was extracted but
    is wrong, and 0.0 when no answer could be extracted.

    Raises:
        ValueError: the ground truth is not a number (it names the value), or an unknown
            ``method``.
    """
    label = normalize_number(str(ground_truth))
    if label is None:
        raise ValueError(f"GSM8K ground truth is not a number: {ground_truth!r}")
    answer = extract_answer(solution_str, method=method)
    if answer is None:
        return {"score": 0.0, "acc": 0.0}
    correct = Decimal(answer) == Decimal(label)
    return {"score": float(score if correct else format_score), "acc": float(correct)}


__all__ = ["EXTRACTION_METHODS", "normalize_number", "extract_answer", "parse_ground_truth", "compute_score"]
