"""Countdown rule reward (the TinyZero task): reach a target with given numbers.

The prompt gives numbers and a target; the response must end with
``<answer>EQUATION</answer>`` where EQUATION uses each given number exactly once with
``+ - * /`` and parentheses, and evaluates to the target. Ground truth:
``{"target": int, "numbers": [int, ...]}`` (the layout of TinyZero/verl countdown data).

The equation is evaluated with a whitelist over Python's ``ast`` (numbers, the four
operators, unary minus), never with ``eval``.
"""
from __future__ import annotations

import ast
import operator
import re
from collections import Counter
from typing import Any

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ALLOWED_CHARS_RE = re.compile(r"[\d+\-*/().\s]+")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def extract_equation(solution_str: str) -> str | None:
    """The text inside the last ``<answer>...</answer>``, stripped, or None."""
    matches = _ANSWER_RE.findall(solution_str)
    return matches[-1].strip() if matches else None


def evaluate_equation(equation: str) -> float | None:
    """Value of an arithmetic expression over numbers and ``+ - * / ( )``, or None.

    None for anything else (names, calls, powers, syntax errors, division by zero).
    """
    if not _ALLOWED_CHARS_RE.fullmatch(equation):
        return None
    try:
        tree = ast.parse(equation, mode="eval")
        return float(_eval_node(tree.body))
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return None


def _eval_node(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        return _BINOPS[type(node.op)](_eval_node(node.left), _eval_node(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval_node(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"disallowed expression node {type(node).__name__}")


def _numbers_in(equation: str) -> list[int]:
    return [int(n) for n in re.findall(r"\d+", equation)]


def compute_score(
    solution_str: str,
    ground_truth: Any,
    extra_info: dict | None = None,
    *,
    format_score: float = 0.1,
    score: float = 1.0,
) -> dict[str, float]:
    """Score a countdown response.

    Returns ``{"score": s, "acc": a}``: ``s = score`` (``a = 1``) when the equation uses
    exactly the given numbers and evaluates to the target (within 1e-5); ``format_score``
    when an ``<answer>`` is present but wrong or invalid; 0 without an answer.

    Raises:
        ValueError: ground truth without integer ``target`` and list ``numbers``.
    """
    try:
        target = int(ground_truth["target"])
        numbers = [int(n) for n in ground_truth["numbers"]]
    except (TypeError, KeyError, ValueError) as exc:
        raise ValueError(
            f"countdown ground truth must be {{'target': int, 'numbers': [int, ...]}}, got {ground_truth!r}"
        ) from exc
    equation = extract_equation(solution_str)
    if equation is None:
        return {"score": 0.0, "acc": 0.0}
    if Counter(_numbers_in(equation)) != Counter(numbers):
        return {"score": float(format_score), "acc": 0.0}
    value = evaluate_equation(equation)
    if value is None or abs(value - target) > 1e-5:
        return {"score": float(format_score), "acc": 0.0}
    return {"score": float(score), "acc": 1.0}
