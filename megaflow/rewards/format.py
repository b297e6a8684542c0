"""Format rewards: score the shape of a response, independent of its correctness.

Used alone (as the reward of a data source) or combined with a correctness reward through
:func:`with_format_reward`, e.g. the ``<think>...</think><answer>...</answer>`` layout of
DeepSeek-R1 style training (DeepSeek-AI 2025, section 2.2.2, "format rewards").
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

#: ``<think>reasoning</think>`` followed by ``<answer>answer</answer>`` and nothing else.
THINK_ANSWER_PATTERN = r"<think>.*?</think>\s*<answer>.*?</answer>"
#: A GSM8K-style final line ``#### <number>`` at the end of the response.
GSM8K_ANSWER_PATTERN = r".*####\s*\$?\s*-?[\d,]*\d(?:\.\d+)?\s*\.?"


def format_reward(solution_str: str, pattern: str = THINK_ANSWER_PATTERN, *, score: float = 1.0) -> float:
    """``score`` if the whole stripped response matches ``pattern`` (dot matches newlines), else 0.

    Raises:
        ValueError: ``pattern`` is not a valid regular expression.
    """
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise ValueError(f"invalid format pattern {pattern!r}: {exc}") from exc
    return float(score) if regex.fullmatch(solution_str.strip()) else 0.0


def with_format_reward(
    compute_score: Callable[..., float | dict], pattern: str, *, format_weight: float = 0.1
) -> Callable[..., dict[str, float]]:
    """Wrap a scorer: ``score = (1 - w) * base + w * format``, with ``w = format_weight``.

    The wrapped function has the scorer signature ``(solution_str, ground_truth,
    extra_info=None, **kwargs)`` and returns the base's dict (or ``{"score": base}``)
    with ``score`` replaced and ``format`` (0 or 1) added.

    Raises:
        ValueError: ``format_weight`` outside [0, 1].
    """
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")

    def scorer(solution_str: str, ground_truth: Any, extra_info: dict | None = None, **kwargs) -> dict:
        base = compute_score(solution_str, ground_truth, extra_info, **kwargs)
        out = dict(base) if isinstance(base, dict) else {"score": float(base)}
        fmt = format_reward(solution_str, pattern)
        out["score"] = (1.0 - format_weight) * float(out["score"]) + format_weight * fmt
        out["format"] = fmt
        return out

    return scorer
