"""Hermes/Qwen tool-call parsing: one result per <tool_call> block, malformed ones named."""
import json

import pytest

from megaflow.agent.parser import MalformedCall, parse_tool_calls
from megaflow.agent.tool import ToolCall

WELL_FORMED = [
    "no call here",
    'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>',
    '<tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b", "arguments": {"x": [1, 2]}}'
    '</tool_call>',
]


def test_calls_in_order():
    calls = parse_tool_calls(WELL_FORMED[2])
    assert calls == [ToolCall("a", {}), ToolCall("b", {"x": [1, 2]})]
    assert parse_tool_calls(WELL_FORMED[0]) == []


def test_arguments_as_json_string():
    text = '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2\\"}"}</tool_call>'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "2"})]


@pytest.mark.parametrize("text, reason", [
    ("<tool_call>{not json}</tool_call>", "not valid JSON"),
    ('<tool_call>["calculator"]</tool_call>', 'string "name"'),
    ('<tool_call>{"arguments": {}}</tool_call>', 'string "name"'),
    ('<tool_call>{"name": "c", "arguments": 3}</tool_call>', '"arguments" must be'),
    ('<tool_call>{"name": "c", "arguments": {', "no closing"),
])
def test_malformed(text, reason):
    (call,) = parse_tool_calls(text)
    assert isinstance(call, MalformedCall) and reason in call.reason


def test_a_malformed_call_does_not_hide_the_others():
    text = '<tool_call>{bad</tool_call><tool_call>{"name": "c", "arguments": {"e": 1}}</tool_call>'
    first, second = parse_tool_calls(text)
    assert isinstance(first, MalformedCall) and second == ToolCall("c", {"e": 1})


class _AnyTokenizer:
    def get_vocab(self):
        return {}


@pytest.mark.parametrize("text", WELL_FORMED)
def test_agrees_with_vllm_hermes_parser_on_well_formed_text(text):
    from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser

    info = Hermes2ProToolParser(_AnyTokenizer()).extract_tool_calls(text, request=None)
    theirs = [ToolCall(c.function.name, json.loads(c.function.arguments)) for c in info.tool_calls]
    assert parse_tool_calls(text) == theirs
