"""agent/* metrics and the readable trajectory text, from hand-built trajectories."""
import pytest

from megaflow.agent.loop import ToolCallRecord, Trajectory
from megaflow.agent.metrics import render_trajectory, trajectory_metrics


def _trajectories():
    a = Trajectory(prompt_ids=[1, 2], response_ids=list(range(10)), num_turns=3, num_observation_tokens=4,
                   stop_reason="answer", calls=[ToolCallRecord("calculator", None, 0.5),
                                                ToolCallRecord("", "malformed", 0.0)],
                   messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "<tool_call>x"},
                             {"role": "tool", "name": "calculator", "content": "3"},
                             {"role": "assistant", "content": "3"}])
    b = Trajectory(prompt_ids=[1], response_ids=list(range(6)), num_turns=1, stop_reason="length",
                   calls=[ToolCallRecord("python", "timeout", 1.5)], template_ok=False)
    return [a, b]


def test_metrics_by_hand():
    m = trajectory_metrics(_trajectories())
    assert m["agent/turns/mean"] == 2.0 and m["agent/turns/max"] == 3.0
    assert m["agent/tool_calls/mean"] == 1.5
    assert m["agent/tool_latency_s/mean"] == pytest.approx(2.0 / 3) and m["agent/tool_latency_s/max"] == 1.5
    assert m["agent/observation_token_share"] == pytest.approx(4 / 16)
    assert m["agent/truncated_share"] == 0.5 and m["agent/stop/answer"] == 0.5 and m["agent/stop/length"] == 0.5
    assert m["agent/template_mismatch"] == 1.0
    assert (m["agent/tool_calls/calculator"], m["agent/tool_calls/python"], m["agent/tool_calls/malformed"]) == (1, 1, 1)
    assert "agent/tool_errors/calculator" not in m and m["agent/tool_errors/python"] == 1
    assert m["agent/tool_error_kind/timeout"] == 1 and m["agent/tool_error_kind/malformed"] == 1
    assert trajectory_metrics([]) == {}


def test_render_marks_roles_and_tools():
    text = render_trajectory(_trajectories()[0])
    assert text == ("[user]\nq\n[assistant]\n<tool_call>x\n[tool calculator]\n3\n[assistant]\n3\n"
                    "[end: answer; 3 turns, 2 tool calls, 1 errors]")
