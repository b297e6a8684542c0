"""The environment interface: ``reset(row) -> messages, tools`` and ``step(calls) -> observations, done, reward``.

An environment holds one trajectory's state. The agent loop calls :meth:`Environment.reset`
with the dataset row, renders the returned messages and tool specs with the chat template,
and after every model turn that contains tool calls passes the parsed calls to
:meth:`Environment.step`; each observation becomes one tool-role message. ``done`` ends
the trajectory after the observations (e.g. a game won or lost); ``reward`` is an optional
environment reward for the trajectory, reported next to the rule reward. A turn without a
tool call always ends the trajectory.

The built-in ``tool_agent`` (:class:`ToolEnvironment`) runs the row's tools and never ends
a trajectory itself.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megaflow.agent.parser import MalformedCall
from megaflow.agent.registry import make_tool, register_environment
from megaflow.agent.tool import Observation, Tool, ToolCall, run_tool_call

DEFAULT_ENVIRONMENT = "tool_agent"


@dataclass(frozen=True)
class EnvReset:
    """The start of a trajectory: chat ``messages`` (role/content dicts) and its ``tools`` by name."""

    messages: list[dict[str, Any]]
    tools: Mapping[str, Tool] = field(default_factory=dict)


@dataclass(frozen=True)
class EnvStep:
    """One environment step: an observation per call (in order), whether it ended, a reward or None."""

    observations: list[Observation]
    done: bool = False
    reward: float | None = None


class Environment(ABC):
    """One trajectory's environment (see the module docstring)."""

    @abstractmethod
    def reset(self, row: Mapping[str, Any]) -> EnvReset:
        """Start a trajectory from a dataset row.

        Raises:
            ValueError: a row this environment cannot use (named in the message).
        """

    @abstractmethod
    def step(self, calls: Sequence[ToolCall | MalformedCall]) -> EnvStep:
        """Answer a turn's calls; must not raise for anything the model wrote."""


def row_messages(row: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of a row's ``prompt`` (a string is one user message).

    Raises:
        ValueError: a prompt that is neither a string nor a list of role/content dicts.
    """
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, Sequence) and prompt and all(
            isinstance(m, Mapping) and isinstance(m.get("role"), str) and "content" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise ValueError(f"prompt must be a string or a list of {{'role', 'content'}} messages, got {prompt!r:.80}")


def row_tools(row: Mapping[str, Any]) -> dict[str, Tool]:
    """The tools a row names in ``extra_info.tools_kwargs`` (verl's layout), built.

    Raises:
        ValueError: ``tools_kwargs`` not a mapping, an unknown tool, bad ``create_kwargs``.
    """
    extra_info = row.get("extra_info") or {}
    tools_kwargs = extra_info.get("tools_kwargs") or {} if isinstance(extra_info, Mapping) else None
    if not isinstance(tools_kwargs, Mapping):
        raise ValueError(f"extra_info.tools_kwargs must map tool names to {{'create_kwargs': {{...}}}}, "
                         f"got {tools_kwargs!r:.80}")
    tools = {}
    for name, kwargs in tools_kwargs.items():
        kwargs = kwargs or {}
        if not isinstance(kwargs, Mapping):
            raise ValueError(f"extra_info.tools_kwargs.{name} must be a mapping, got {kwargs!r:.80}")
        tools[name] = make_tool(name, kwargs.get("create_kwargs"))
    return tools


def malformed_observation(call: MalformedCall) -> Observation:
    """The error observation for a ``<tool_call>`` block that could not be parsed."""
    return Observation(f"Error: malformed tool call: {call.reason}", error="malformed")


@register_environment(DEFAULT_ENVIRONMENT)
class ToolEnvironment(Environment):
    """Runs the row's tools (``extra_info.tools_kwargs``) on each call; never ends a trajectory itself."""

    def __init__(self) -> None:
        self.tools: dict[str, Tool] = {}

    def reset(self, row: Mapping[str, Any]) -> EnvReset:
        self.tools = row_tools(row)
        return EnvReset(row_messages(row), self.tools)

    def step(self, calls: Sequence[ToolCall | MalformedCall]) -> EnvStep:
        return EnvStep([malformed_observation(c) if isinstance(c, MalformedCall) else run_tool_call(c, self.tools)
                        for c in calls])


def check_rows(rows: Sequence[Mapping[str, Any]], source: str = "dataset",
               locations: Sequence[str] | None = None) -> None:
    """Refuse, at load, rows naming an unknown environment or tool (or unusable tool kwargs).

    Args:
        rows: ``{"prompt", "extra_info", "agent_name"}`` per row.
        source: names the rows in errors (``"<source> row <i>"``).
        locations: each row's own name in errors instead (e.g. ``"train.parquet, row 12"``).

    Raises:
        ValueError: ``"<source> row <i>: <reason>"`` (or ``"<location>: <reason>"``) for the first bad row.
    """
    from megaflow.agent.registry import make_environment

    for i, row in enumerate(rows):
        try:
            make_environment(row.get("agent_name") or DEFAULT_ENVIRONMENT).reset(row)
        except ValueError as e:
            where = locations[i] if locations is not None else f"{source} row {i}"
            raise ValueError(f"{where}: {e}") from None
