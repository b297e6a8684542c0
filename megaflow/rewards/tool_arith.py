"""Rule reward of the tiny agent task (:mod:`megaflow.data.tool_arith`): the answer, the call, and shaping.

The response text is the sampled tokens of every assistant turn, special tokens kept
(``<tool_call>...</tool_call><eos>132<eos>``: the turns end with ``<eos>``; the observations
are not part of it). A random policy almost never writes a whole correct call, so the reward
is graded, each tier above the ones below (reward shaping, Ng et al. 1999, as a curriculum):

=====================================================================  ======================
the response                                                           score
=====================================================================  ======================
the last finished turn is the exact answer (digits) and calls no tool  1
a calculator call whose expression has the answer's value              0.5
a call the calculator evaluates to ``v``                               ``0.15 + 0.25 c``,
                                                                       ``c = max(0, 1 - |v - answer| / answer)``
a well-formed call (``<tool_call>{json}</tool_call>``)                 0.1
a wrong number as the last finished turn                               0.05
otherwise                                                              0
=====================================================================  ======================

Calls count in finished turns only (the agent loop runs no call of a turn cut at the length limit).

Returned parts: ``score``, ``acc`` (exact final answer), ``tool_correct`` (a call with the
answer's value: the fraction of trajectories with a correct tool call), ``tool_call`` (a call
the calculator evaluates).
"""
from __future__ import annotations

from fractions import Fraction
from typing import Any

from megaflow.agent.calculator import evaluate
from megaflow.agent.parser import CALL_START, parse_tool_calls
from megaflow.agent.tool import ToolCall, ToolError
from megaflow.data.tool_arith import EOS_TOKEN


def _call_values(text: str) -> list[Fraction]:
    """The values of the calculator calls in ``text`` the calculator can evaluate."""
    values = []
    for call in parse_tool_calls(text):
        if isinstance(call, ToolCall) and call.name == "calculator":
            expression = call.arguments.get("expression")
            try:
                values.append(evaluate(expression)) if isinstance(expression, str) else None
            except ToolError:
                pass
    return values


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> dict[str, float]:
    """Score one multi-turn response (module docstring's table).

    Raises:
        ValueError: ``ground_truth`` is not an integer.
    """
    answer = int(ground_truth)
    turns = solution_str.split(EOS_TOKEN)[:-1]  # finished turns (the text after the last <eos> is cut off)
    final = turns[-1].strip() if turns else ""
    acc = final.isdigit() and CALL_START not in final and int(final) == answer
    finished = EOS_TOKEN.join(turns)
    values = _call_values(finished)
    correct = any(v == answer for v in values)
    if acc:
        score = 1.0
    elif correct:
        score = 0.5
    elif values:
        closeness = max(max(0.0, 1.0 - abs(float(v) - answer) / max(abs(answer), 1)) for v in values)
        score = 0.15 + 0.25 * closeness
    elif any(isinstance(c, ToolCall) for c in parse_tool_calls(finished)):
        score = 0.1
    elif final.isdigit():
        score = 0.05
    else:
        score = 0.0
    return {"score": score, "acc": float(acc), "tool_correct": float(correct), "tool_call": float(bool(values))}


__all__ = ["compute_score"]
