"""Hermes/Qwen tool calls in a turn's text: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

The format Qwen2.5/Qwen3 and Hermes chat templates teach (and vLLM's ``hermes`` tool parser
reads). megaflow parses it itself because a rollout needs one result per call: vLLM's
``Hermes2ProToolParser.extract_tool_calls`` returns "no tool called" for the whole turn
when any one call is not valid JSON (it logs the exception), so the model would never be
told its call was malformed. On well-formed text both agree (``tests/agent/test_parser.py``
checks that against vLLM's parser).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from megaflow.agent.tool import ToolCall

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"
_CALL = re.compile(re.escape(CALL_START) + r"(.*?)(?:" + re.escape(CALL_END) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class MalformedCall:
    """A ``<tool_call>`` block that is not a call; ``reason`` is shown to the model."""

    text: str
    reason: str


def parse_tool_calls(text: str) -> list[ToolCall | MalformedCall]:
    """The calls in ``text``, in order; a block that cannot be read is a :class:`MalformedCall`.

    A call is a JSON object with a string ``name`` and an object ``arguments`` (a JSON string
    holding an object is accepted too, as some models write it); a block missing its
    ``</tool_call>`` (the turn ended inside it) is malformed. Text without ``<tool_call>``
    has no calls.
    """
    return [_parse_one(m.group(1), closed=m.group(0).endswith(CALL_END)) for m in _CALL.finditer(text)]


def _parse_one(body: str, closed: bool) -> ToolCall | MalformedCall:
    if not closed:
        return MalformedCall(body, f"the call has no closing {CALL_END}")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(body, f"the call is not valid JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return MalformedCall(body, 'the call must be a JSON object with a string "name"')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return MalformedCall(body, '"arguments" must be a JSON object')
    return ToolCall(obj["name"], arguments)
