"""Rule reward of the arithmetic task (:mod:`megaflow.data.arith`): exact match + shaping.

A tiny randomly initialised policy never produces an exact sum by chance often enough
for policy-gradient RL to start, so the reward is graded (reward shaping, Ng et al. 1999,
is used here only as a curriculum; the exact-match term dominates):

============================================  ==============================================
response (text up to and including <eos>)      score
============================================  ==============================================
not ``<digits><eos>`` (no EOS, empty, other)   0
the exact answer, then ``<eos>``               1
a wrong number, then ``<eos>``                 ``format_score + closeness_weight * c``,
                                               ``c = 1 / (1 + |pred - answer|)``
============================================  ==============================================

With the defaults (0.1, 0.4) a wrong but well-formed answer earns 0.1..0.3, always less
than an exact one. The response is read with special tokens kept (the registry decodes
``arith`` that way), because "terminated by EOS" is part of the format: without that
requirement a random policy learns to fill the whole response with digits.
"""
from __future__ import annotations

import re
from typing import Any

from megaflow.data.arith import EOS_TOKEN

_ANSWER_RE = re.compile(r"\s*(-?\d{1,18})\s*" + re.escape(EOS_TOKEN))


def parse_arith_response(solution_str: str, *, eos_token: str = EOS_TOKEN) -> int | None:
    """The integer answered by ``solution_str`` (``"19<eos>"`` -> 19), or None.

    Only the text before the first ``eos_token`` is read; it must be an integer
    (optional spaces around it). A response without ``eos_token`` is unterminated and
    returns None.
    """
    pattern = _ANSWER_RE if eos_token == EOS_TOKEN else re.compile(
        r"\s*(-?\d{1,18})\s*" + re.escape(eos_token))
    head, sep, _ = solution_str.partition(eos_token)
    if not sep:
        return None
    match = pattern.fullmatch(head + eos_token)
    return int(match.group(1)) if match else None


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    format_score: float = 0.1,
    closeness_weight: float = 0.4,
    eos_token: str = EOS_TOKEN,
) -> dict[str, float]:
    """Score one arithmetic response (see the module docstring for the table).

    Returns ``{"score": s, "acc": exact, "format": well_formed}`` (floats).

    Raises:
        ValueError: ``ground_truth`` is not an integer, or ``format_score +
            closeness_weight >= 1`` (a wrong answer must score below an exact one).
    """
    if format_score + closeness_weight >= 1.0:
        raise ValueError(
            f"format_score + closeness_weight must be < 1 (the exact-answer score), "
            f"got {format_score} + {closeness_weight}"
        )
    try:
        answer = int(str(ground_truth).strip())
    except ValueError as exc:
        raise ValueError(f"arith ground truth is not an integer: {ground_truth!r}") from exc
    pred = parse_arith_response(solution_str, eos_token=eos_token)
    if pred is None:
        return {"score": 0.0, "acc": 0.0, "format": 0.0}
    if pred == answer:
        return {"score": 1.0, "acc": 1.0, "format": 1.0}
    closeness = 1.0 / (1.0 + abs(pred - answer))
    return {"score": format_score + closeness_weight * closeness, "acc": 0.0, "format": 1.0}
