"""Tools and environments by name, registered like rewards (:mod:`megaflow.rewards.registry`).

A dataset row chooses them in verl's multi-turn layout::

    {"prompt": [{"role": "user", "content": "..."}],
     "agent_name": "tool_agent",                      # the environment (default "tool_agent")
     "extra_info": {"tools_kwargs": {                 # the row's tools, by name
         "calculator": {"create_kwargs": {}},
         "python": {"create_kwargs": {"timeout_s": 5}}}}}

``create_kwargs`` are passed to the tool's factory. Built in: tools ``calculator``
(:class:`~megaflow.agent.calculator.Calculator`) and ``python``
(:class:`~megaflow.agent.sandbox.PythonInterpreter`); environment ``tool_agent``
(:class:`~megaflow.agent.environment.ToolEnvironment`).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from megaflow.agent.calculator import Calculator
from megaflow.agent.sandbox import PythonInterpreter
from megaflow.agent.tool import Tool, check_schema

ToolFactory = Callable[..., Tool]
EnvFactory = Callable[..., Any]

_TOOLS: dict[str, ToolFactory] = {"calculator": Calculator, "python": PythonInterpreter}
_ENVS: dict[str, EnvFactory] = {}


def _register(table: dict, kind: str, name: str, override: bool) -> Callable:
    def decorator(factory: Callable) -> Callable:
        if name in table and not override:
            raise ValueError(f"{kind} {name!r} is already registered; pass override=True to replace it")
        table[name] = factory
        return factory

    return decorator


def register_tool(name: str, override: bool = False) -> Callable[[ToolFactory], ToolFactory]:
    """Decorator registering a tool factory (a :class:`Tool` subclass or function) under ``name``.

    Raises:
        ValueError: ``name`` is taken and ``override`` is False.
    """
    return _register(_TOOLS, "tool", name, override)


def register_environment(name: str, override: bool = False) -> Callable[[EnvFactory], EnvFactory]:
    """Decorator registering an environment factory under ``name`` (see :func:`register_tool`)."""
    return _register(_ENVS, "environment", name, override)


def unregister_tool(name: str) -> None:
    """Remove a registered tool (KeyError if unknown)."""
    del _TOOLS[name]


def unregister_environment(name: str) -> None:
    """Remove a registered environment (KeyError if unknown)."""
    del _ENVS[name]


def known_tools() -> list[str]:
    """Sorted names of the registered tools."""
    return sorted(_TOOLS)


def known_environments() -> list[str]:
    """Sorted names of the registered environments."""
    return sorted(_ENVS)


def make_tool(name: str, create_kwargs: Mapping[str, Any] | None = None) -> Tool:
    """Build tool ``name`` with ``create_kwargs`` and check its schema.

    Raises:
        ValueError: unknown tool (listing the known ones), kwargs the factory refuses,
            or a name/schema :func:`~megaflow.agent.tool.check_schema` refuses.
    """
    if name not in _TOOLS:
        raise ValueError(f"unknown tool {name!r}; known tools: {', '.join(known_tools())} "
                         f"(add one with megaflow.agent.register_tool)")
    try:
        tool = _TOOLS[name](**dict(create_kwargs or {}))
    except TypeError as e:
        raise ValueError(f"tool {name!r}: bad create_kwargs {dict(create_kwargs or {})}: {e}") from None
    check_schema(tool)
    if tool.name != name:
        raise ValueError(f"tool registered as {name!r} calls itself {tool.name!r}")
    return tool


def make_environment(name: str, **kwargs: Any):
    """Build environment ``name``.

    Raises:
        ValueError: unknown environment (listing the known ones).
    """
    if name not in _ENVS:
        raise ValueError(f"unknown environment {name!r}; known environments: {', '.join(known_environments())} "
                         f"(add one with megaflow.agent.register_environment)")
    return _ENVS[name](**kwargs)
