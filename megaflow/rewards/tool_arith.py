"""Rule reward of the tiny agent task (:mod:`megaflow.data.tool_arith`): the call, then the answer.

The response text is the sampled tokens of every assistant turn, special tokens kept
(``<tool_call>...</tool_call><eos>132<eos>``: the turns end with ``<eos>``; the observations
are not part of it). A random policy almost never writes a whole correct call, so the reward
is graded (reward shaping, Ng et al. 1999), each tier above the ones below:

=======================================================================  ==========================
the response                                                             score
=======================================================================  ==========================
the first turn is one correct call, the last finished turn is the answer  1
the first turn is one calculator call with the answer's value             ``0.6 + 0.3 h(final, answer)``
otherwise                                                                 ``0.5 h(first turn, call)``
=======================================================================  ==========================

``h(x, y)``: the Hamming similarity of the token sequences ``x`` and ``y`` (the tokens equal
at the same position, over the longer one's length; 0 if either is empty). ``call`` is the
correct call's tokens, ``<call>a+b<end_call>`` with ``a``, ``b`` from the row's
``extra_info``; the first turn is the text up to its ``<eos>`` (the whole response when it
has none). The shaping tier is positional on purpose: a policy that repeats one digit, or
writes an empty call, earns no more than chance there, so the only way up is to copy each
operand digit into its place (the longest-common-subsequence credit of earlier versions was
won by such policies, which then stopped exploring). A call must be the turn's only one.
The value of a call is checked with the calculator (``85+47`` is correct too).

Returned parts: ``score``, ``acc`` (the final answer exact after a correct call),
``tool_correct`` (the fraction of trajectories with a correct tool call), ``tool_call``
(a well-formed single calculator call in the first turn).
"""
from __future__ import annotations

import functools
from typing import Any

from megaflow.agent.calculator import evaluate
from megaflow.agent.parser import parse_tool_calls
from megaflow.agent.tool import ToolCall, ToolError
from megaflow.data.tool_arith import CALL_CLOSE, CALL_OPEN, EOS_TOKEN, build_tool_arith_tokenizer


@functools.lru_cache(maxsize=1)
def _tokenizer():
    return build_tool_arith_tokenizer()


def _hamming(text: str, target: str) -> float:
    """Tokens of ``text`` equal to ``target``'s at the same position, over the longer length (0 if one is empty)."""
    x, y = (_tokenizer().encode(t, add_special_tokens=False) for t in (text, target))
    if not x or not y:
        return 0.0
    same = sum(a == b for a, b in zip(x, y, strict=False))  # unequal lengths: the tokens past the shorter differ
    return same / max(len(x), len(y))


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
        score = 0.6 + 0.3 * _hamming(final, answer)
    else:
        call = f"{CALL_OPEN}{info.get('a', '')}{info.get('op', '+')}{info.get('b', '')}{CALL_CLOSE}"
        score = 0.5 * _hamming(turns[0] if turns else solution_str, call)
    return {"score": score, "acc": float(acc), "tool_correct": float(correct),
            "tool_call": float(expression is not None)}


__all__ = ["compute_score"]
