"""Tool descriptions as a system message, for chat templates that ignore ``tools=[...]``.

Qwen2.5/Qwen3 and Hermes templates render the tool specs passed to ``apply_chat_template``
into their system prompt; SmolLM2's template (and other plain ChatML ones) drops them, so a
model served with it never learns what it may call. :func:`tool_system_prompt` writes the
content those templates carry (the OpenAI function specs as JSON inside ``<tools>`` and
the ``<tool_call>`` call format that :mod:`megaflow.agent.parser` reads), in its own words,
as plain text, and :func:`with_tool_system_prompt` puts it into a verl multi-turn row: a system
message first and the tools in ``extra_info.tools_kwargs``.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from megaflow.agent.parser import CALL_END, CALL_START
from megaflow.agent.registry import make_tool


def tool_system_prompt(tool_names: Sequence[str], preamble: str = "You are a helpful assistant.") -> str:
    """The system prompt describing ``tool_names`` (registered tools) and how to call them.

    Raises:
        ValueError: no names, or an unknown one (:func:`megaflow.agent.registry.make_tool`).
    """
    if not tool_names:
        raise ValueError("tool_system_prompt needs at least one tool name")
    tools = [make_tool(name, None) for name in tool_names]
    specs = "\n".join(json.dumps(tool.spec()) for tool in tools)
    first = tools[0]
    properties = first.parameters.get("properties", {})
    example = json.dumps({"name": first.name, "arguments": {
        key: _example_value(properties.get(key, {})) for key in first.parameters.get("required", [])}})
    return (f"{preamble}\n\nTools you can use (OpenAI function specs, one JSON object a line):\n<tools>\n{specs}\n"
            f"</tools>\nTo use a tool, write a call like this one (its name and arguments as JSON) and end your "
            f"message there:\n{CALL_START}{example}{CALL_END}\nThe tool's reply comes "
            f"in the next message; then go on.")


def _example_value(schema: Mapping[str, Any]) -> str:
    """A parameter's example from its description's ``"e.g. ..."`` (the calculator's ``(12 + 7) * 3``), else ``...``."""
    description = str(schema.get("description", ""))
    return description[len("e.g. "):] if description.startswith("e.g. ") else "..."


def with_tool_system_prompt(row: Mapping[str, Any], tool_names: Sequence[str], system_prompt: str) -> dict[str, Any]:
    """A copy of the verl row ``row`` with ``system_prompt`` as its first message (replacing a
    system message it had) and ``tool_names`` in ``extra_info.tools_kwargs`` (no create kwargs)."""
    messages = [dict(m) for m in row["prompt"] if m.get("role") != "system"]
    extra_info = dict(row.get("extra_info") or {})
    extra_info["tools_kwargs"] = {name: {"create_kwargs": {}} for name in tool_names}
    return {**row, "prompt": [{"role": "system", "content": system_prompt}, *messages], "extra_info": extra_info}


__all__ = ["tool_system_prompt", "with_tool_system_prompt"]
