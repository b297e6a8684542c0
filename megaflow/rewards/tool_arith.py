"""Rule reward of the tiny agent task (:mod:`megaflow.data.tool_arith`): the call, then the answer.

The response text is the sampled tokens of every assistant turn, special tokens kept
(``<tool_call>...</tool_call><eos>132<eos>``: the turns end with ``<eos>``; the observations
are not part of it). A random policy almost never writes a whole correct call, so the reward
is graded, each tier above the ones below (reward shaping, Ng et al. 1999, as a curriculum of
copying: first the operands into the call, then the calculator's answer into the last turn):

===========================================================================  ========================
the response                                                                 score
===========================================================================  ========================
the first turn is one correct call, the last finished turn is the answer     1
the first turn is one calculator call with the answer's value                ``0.5 + 0.3 p(final, answer)``
the first turn is one calculator call (a well-formed call)                   ``0.1 + 0.3 p(expression, "a+b")``
otherwise                                                                    0
===========================================================================  ========================

``p(x, y)``: the longest common subsequence of ``x`` and ``y`` over the longer one's length
(so each character copied in order counts and extra characters cost; a call must be the
turn's only one: several calls, whose observations would crowd the answer out of the
response, earn nothing). ``a`` and ``b``
come from the row's ``extra_info`` (the value of a call is checked with the calculator:
``85+47`` is correct too).

Returned parts: ``score``, ``acc`` (the final answer exact after a correct call),
``tool_correct`` (the fraction of trajectories with a correct tool call), ``tool_call``
(a well-formed single calculator call in the first turn).
"""
from __future__ import annotations

from typing import Any

from megaflow.agent.calculator import evaluate
from megaflow.agent.parser import parse_tool_calls
from megaflow.agent.tool import ToolCall, ToolError
from megaflow.data.tool_arith import EOS_TOKEN


def _similarity(text: str, target: str) -> float:
    """``LCS(text, target) / max(len(text), len(target))`` (0 for two empty strings)."""
    if not text or not target:
        return 0.0
    previous = [0] * (len(target) + 1)
    for ch in text:  # the textbook dynamic programme, one row at a time
        row = [0]
        for j, other in enumerate(target):
            row.append(previous[j] + 1 if ch == other else max(previous[j + 1], row[j]))
        previous = row
    return previous[-1] / max(len(text), len(target))


def _first_call(turn: str) -> str | None:
    """The expression of the turn's call when the turn is one calculator call, else None."""
    calls = parse_tool_calls(turn)
    if len(calls) != 1 or not isinstance(calls[0], ToolCall) or calls[0].name != "calculator":
        return None
    expression = calls[0].arguments.get("expression")
    return expression if isinstance(expression, str) else None


def _value(expression: str) -> int | None:
    try:
        value = evaluate(expression)
    except ToolError:
        return None
    return int(value) if value.denominator == 1 else None


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, float]:
    """Score one multi-turn response (module docstring's table).

    Raises:
        ValueError: ``ground_truth`` is not an integer.
    """
    answer = str(int(ground_truth))
    info = extra_info or {}
    turns = solution_str.split(EOS_TOKEN)[:-1]  # finished turns (the text after the last <eos> is cut off)
    expression = _first_call(turns[0]) if turns else None
    correct = expression is not None and _value(expression) == int(answer)
    final = turns[-1].strip() if len(turns) > 1 else ""
    acc = correct and final == answer
    if acc:
        score = 1.0
    elif correct:
        score = 0.5 + 0.3 * _similarity(final, answer)
    elif expression is not None:
        score = 0.1 + 0.3 * _similarity(expression, f"{info.get('a', '')}{info.get('op', '+')}{info.get('b', '')}")
    else:
        score = 0.0
    return {"score": score, "acc": float(acc), "tool_correct": float(correct),
            "tool_call": float(expression is not None)}


__all__ = ["compute_score"]
