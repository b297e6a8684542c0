"""Agentic, multi-turn rollouts: tools, environments, tool-call parsing and the sandbox.

Public interface: :class:`Tool` (name, JSON schema, ``call(args) -> text``),
:class:`Environment` (``reset(row)``, ``step(calls)``), :func:`register_tool`,
:func:`register_environment`, :func:`parse_tool_calls`; built-in tools ``calculator`` and
``python`` (sandboxed), built-in environment ``tool_agent``. The rollout side:
:class:`AgentLoop` (one replica's multi-turn loop), :class:`ChatRenderer` (the chat template
in token ids), :func:`megaflow.agent.vllm_agent.generate_agent_sequences` (on a
``VLLMRollout``), :func:`trajectory_metrics` and :func:`render_trajectory`.
"""
from megaflow.agent.calculator import Calculator
from megaflow.agent.environment import (
    Environment,
    EnvReset,
    EnvStep,
    ToolEnvironment,
    check_rows,
    row_messages,
    row_tools,
)
from megaflow.agent.loop import AgentLimits, AgentLoop, Trajectory, tp_broadcaster
from megaflow.agent.metrics import render_trajectory, trajectory_metrics
from megaflow.agent.parser import MalformedCall, parse_tool_calls
from megaflow.agent.registry import (
    known_environments,
    known_tools,
    make_environment,
    make_tool,
    register_environment,
    register_tool,
    unregister_environment,
    unregister_tool,
)
from megaflow.agent.sandbox import PythonInterpreter, SandboxLimits, SandboxResult, run_python
from megaflow.agent.template import ChatRenderer
from megaflow.agent.tool import Observation, Tool, ToolCall, ToolError, check_schema, run_tool_call

__all__ = [
    "AgentLimits", "AgentLoop", "ChatRenderer", "Trajectory", "render_trajectory", "tp_broadcaster",
    "trajectory_metrics", "Calculator", "EnvReset", "EnvStep", "Environment", "MalformedCall", "Observation",
    "PythonInterpreter",
    "SandboxLimits", "SandboxResult", "Tool", "ToolCall", "ToolEnvironment", "ToolError", "check_rows",
    "check_schema", "known_environments", "known_tools", "make_environment", "make_tool", "parse_tool_calls",
    "register_environment", "register_tool", "row_messages", "row_tools", "run_python", "run_tool_call",
    "unregister_environment", "unregister_tool",
]
