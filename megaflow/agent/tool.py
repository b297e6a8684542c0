"""The public interface of a tool: a name, a JSON schema for its arguments, ``call(args) -> text``.

A tool is what the policy may call in a multi-turn rollout. Its schema is the OpenAI
function-calling ``parameters`` object (a JSON schema of an object); the chat template
renders :meth:`Tool.spec` into the system prompt, the policy writes a Hermes/Qwen call
(``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
:mod:`megaflow.agent.parser`) and :func:`run_tool_call` turns the call into the text of a
tool-role message. Whatever goes wrong - unknown tool, arguments that do not match the
schema, an exception in the tool, a timeout - comes back as an error observation
(:class:`Observation` with ``error`` set); the rollout never crashes on a tool.
"""
from __future__ import annotations

import concurrent.futures
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: the tool's name and its arguments (a JSON object)."""

    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Observation:
    """What a tool call returns to the model.

    Attributes:
        text: the tool-role message content shown to the model.
        tool: the called tool's name ("" for a call that could not be parsed).
        error: a short error kind (``"malformed"``, ``"unknown_tool"``, ``"bad_arguments"``,
            ``"exception"``, ``"timeout"`` or a tool's own kind) or None on success.
        seconds: wall-clock seconds spent in the tool.
    """

    text: str
    tool: str = ""
    error: str | None = None
    seconds: float = 0.0


class ToolError(Exception):
    """Raised by a tool for an expected failure; ``kind`` names it in metrics."""

    def __init__(self, message: str, kind: str = "tool_error"):
        super().__init__(message)
        self.kind = kind


class Tool(ABC):
    """A callable tool. Subclasses set ``name``, ``description``, ``parameters`` and :meth:`call`.

    ``parameters`` is a JSON schema (draft 2020-12) of the arguments object; it is checked
    when the tool is built (:func:`check_schema`) and every call's arguments are validated
    against it before :meth:`call` runs.
    """

    name: str = ""
    description: str = ""
    parameters: Mapping[str, Any] = {"type": "object", "properties": {}}
    #: wall-clock limit of one call in seconds (:func:`run_tool_call` stops waiting after it).
    timeout_s: float = 10.0

    @abstractmethod
    def call(self, args: Mapping[str, Any]) -> str:
        """Run the tool on validated ``args``; return the observation text.

        Raises:
            ToolError: an expected failure (reported to the model with its message).
            Exception: anything else is reported as ``"exception"``.
        """

    def spec(self) -> dict[str, Any]:
        """The OpenAI function-calling spec the chat template renders (``tools=[...]``)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description,
                             "parameters": dict(self.parameters)}}


def check_schema(tool: Tool) -> None:
    """Refuse a tool whose name or argument schema cannot be used.

    Raises:
        ValueError: empty name, a schema that is not a valid JSON schema, or one that is
            not an ``object`` schema (a call's arguments are always a JSON object).
    """
    if not tool.name or not isinstance(tool.name, str):
        raise ValueError(f"tool {type(tool).__name__} has no name")
    try:
        jsonschema.Draft202012Validator.check_schema(tool.parameters)
    except jsonschema.SchemaError as e:
        raise ValueError(f"tool {tool.name!r}: parameters is not a valid JSON schema: {e.message}") from None
    if tool.parameters.get("type") != "object":
        raise ValueError(f"tool {tool.name!r}: parameters must be a JSON schema of type 'object', "
                         f"got type {tool.parameters.get('type')!r}")


_CALL_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="megaflow-tool")


def run_tool_call(call: ToolCall, tools: Mapping[str, Tool]) -> Observation:
    """Run one parsed call against the trajectory's tools; never raises.

    A tool runs in a worker thread and the caller stops waiting after ``tool.timeout_s``;
    a Python thread cannot be killed, so a tool that must not outlive its timeout does
    its work in a separate process and kills it itself (the Python interpreter does:
    :mod:`megaflow.agent.sandbox`).
    """
    tool = tools.get(call.name)
    if tool is None:
        return Observation(f"Error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}",
                           tool=call.name, error="unknown_tool")
    errors = sorted(jsonschema.Draft202012Validator(tool.parameters).iter_errors(dict(call.arguments)),
                    key=lambda e: list(e.path))
    if errors:
        return Observation(f"Error: bad arguments for {call.name}: {errors[0].message}",
                           tool=call.name, error="bad_arguments")
    start = time.monotonic()
    future = _CALL_POOL.submit(tool.call, call.arguments)
    try:
        text = future.result(timeout=tool.timeout_s)
    except concurrent.futures.TimeoutError:
        return Observation(f"Error: {call.name} timed out after {tool.timeout_s:g} s", tool=call.name,
                           error="timeout", seconds=time.monotonic() - start)
    except ToolError as e:
        return Observation(f"Error: {e}", tool=call.name, error=e.kind, seconds=time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 - a tool's bug becomes an observation, not a crashed step
        return Observation(f"Error: {call.name} raised {type(e).__name__}: {e}", tool=call.name,
                           error="exception", seconds=time.monotonic() - start)
    return Observation(str(text), tool=call.name, seconds=time.monotonic() - start)
