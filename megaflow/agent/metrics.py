"""Metrics and readable samples of a batch of multi-turn trajectories.

:func:`trajectory_metrics` gives, under ``agent/``: turns per trajectory (mean, max), tool calls
per trajectory, calls and errors per tool (``agent/tool_calls/<tool>``,
``agent/tool_errors/<tool>``; a malformed call counts under ``malformed``) and per error kind
(``agent/tool_error_kind/<kind>``), tool latency (mean, max seconds per call), the share of
observation tokens among response tokens, the share of trajectories cut by a limit
(``truncated_share``: stop reasons ``length``, ``max_turns``, ``tool_time``), the share of each
stop reason, and the number of trajectories whose ids differ from the chat template's
rendering (``template_mismatch``, see :mod:`megaflow.agent.template`).

:func:`render_trajectory` writes one trajectory as text with every message marked by its role
(``[tool calculator]`` for observations) for a person to read.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from megaflow.agent.loop import STOP_REASONS, ToolCallRecord, Trajectory

TRUNCATIONS = ("length", "max_turns", "tool_time")


class TrajectoryCounts(Protocol):
    """What the metrics read of a trajectory (a :class:`Trajectory` or a batch row's counts)."""

    num_turns: int
    calls: list[ToolCallRecord]
    num_observation_tokens: int
    stop_reason: str
    template_ok: bool

    @property
    def num_response_tokens(self) -> int: ...


@dataclass
class RowCounts:
    """A rollout batch row's per-trajectory counts (the ``agent_*`` columns of :mod:`megaflow.agent.batch`)."""

    num_turns: int
    calls: list[ToolCallRecord]
    num_observation_tokens: int
    num_response_tokens: int
    stop_reason: str
    template_ok: bool


def batch_counts(non_tensors: Mapping[str, np.ndarray], response_tokens: Sequence[int]) -> list[RowCounts]:
    """The :class:`RowCounts` of a rollout batch's rows.

    Args:
        non_tensors: the batch's ``agent_*`` columns (``agent_turns``, ``agent_calls``,
            ``agent_observation_tokens``, ``agent_stop_reason``, ``agent_template_ok``).
        response_tokens: each row's response tokens (sampled + observation), e.g. the
            response part of ``attention_mask`` summed.
    """
    return [RowCounts(int(non_tensors["agent_turns"][i]),
                      [ToolCallRecord(*c) for c in non_tensors["agent_calls"][i]],
                      int(non_tensors["agent_observation_tokens"][i]), int(response_tokens[i]),
                      str(non_tensors["agent_stop_reason"][i]), bool(non_tensors["agent_template_ok"][i]))
            for i in range(len(response_tokens))]


def trajectory_metrics(trajectories: Sequence[TrajectoryCounts]) -> dict[str, float]:
    """The ``agent/*`` metrics of a batch (module docstring); empty for no trajectories."""
    if not trajectories:
        return {}
    count = len(trajectories)
    calls = [c for t in trajectories for c in t.calls]
    response_tokens = sum(t.num_response_tokens for t in trajectories)
    stops = Counter(t.stop_reason for t in trajectories)
    metrics = {
        "agent/turns/mean": sum(t.num_turns for t in trajectories) / count,
        "agent/turns/max": float(max(t.num_turns for t in trajectories)),
        "agent/tool_calls/mean": len(calls) / count,
        "agent/tool_latency_s/mean": sum(c.seconds for c in calls) / len(calls) if calls else 0.0,
        "agent/tool_latency_s/max": max((c.seconds for c in calls), default=0.0),
        "agent/observation_token_share": (sum(t.num_observation_tokens for t in trajectories) / response_tokens
                                          if response_tokens else 0.0),
        "agent/truncated_share": sum(stops[r] for r in TRUNCATIONS) / count,
        "agent/template_mismatch": float(sum(not t.template_ok for t in trajectories)),
    }
    metrics.update({f"agent/stop/{reason}": stops[reason] / count for reason in STOP_REASONS})
    for tool, n in Counter(c.tool or "malformed" for c in calls).items():
        metrics[f"agent/tool_calls/{tool}"] = float(n)
    for tool, n in Counter(c.tool or "malformed" for c in calls if c.error is not None).items():
        metrics[f"agent/tool_errors/{tool}"] = float(n)
    for kind, n in Counter(c.error for c in calls if c.error is not None).items():
        metrics[f"agent/tool_error_kind/{kind}"] = float(n)
    return metrics


def render_trajectory(trajectory: Trajectory) -> str:
    """The conversation as text: ``[role]`` or ``[tool NAME]`` before each message, then the stop reason."""
    parts = []
    for message in trajectory.messages:
        role = message["role"]
        label = f"tool {message.get('name') or '?'}" if role == "tool" else role
        parts.append(f"[{label}]\n{message['content']}")
    parts.append(f"[end: {trajectory.stop_reason}; {trajectory.num_turns} turns, {trajectory.num_tool_calls} tool "
                 f"calls, {trajectory.num_tool_errors} errors]")
    return "\n".join(parts)
