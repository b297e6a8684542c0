"""The run's side of rollout.agent: the config's limits reach the replica's loop, the generate
call carries the rows' messages and tools only when the agent is on, the join computes the
agent/* metrics over all rows (the per-replica results merged), and validation writes sample
trajectories to the run directory."""
import numpy as np
import pytest
import torch

from megaflow.agent.batch import assemble_agent_batch
from megaflow.agent.loop import AgentLoop, ToolCallRecord, Trajectory
from megaflow.agent.metrics import trajectory_metrics
from megaflow.config.loader import load_config
from megaflow.data.tool_arith import CALL_CLOSE, CALL_OPEN, TOOL_ARITH_VOCAB
from megaflow.protocol import DataProto
from megaflow.trainer.generations import write_trajectories
from megaflow.trainer.proxies import ActorProxy, RolloutProxy, inputs_for
from megaflow.trainer.rollout_source import agent_input_keys
from megaflow.trainer.stages import generation_request, join_rollout
from megaflow.workers.agent_hook import ReplicaAgent
from test_loop import ScriptedEngine

V = {t: i for i, t in enumerate(TOOL_ARITH_VOCAB)}
CALL_TURN = [V[CALL_OPEN], V["1"], V["+"], V["2"], V[CALL_CLOSE], V["<eos>"]]
ROW = {"prompt": [{"role": "user", "content": "1+2="}], "extra_info": {"tools_kwargs": {"calculator": {}}}}


def _run(overrides):
    """One trajectory that calls the calculator every turn, on the loop the config builds."""
    agent = ReplicaAgent(load_config("tiny_tool_grpo", ["rollout.response_length=40", *overrides]), rank=0, tp_group_ranks=[[0]])
    loop = AgentLoop(ScriptedEngine([[CALL_TURN] * 5], delay=1), agent.renderer, agent.decode, agent.limits,
                     eos_token_ids=[V["<eos>"]], max_model_len=64, is_tool_rank=agent.is_tool_rank)
    return loop.run([ROW], seeds=[0])[0]


def test_rollout_agent_max_turns_ends_a_calling_trajectory():
    assert (_run([]).num_turns, _run([]).stop_reason) == (3, "max_turns")  # the recipe's rollout.agent.max_turns
    t = _run(["rollout.agent.max_turns=2"])
    assert (t.num_turns, t.stop_reason, t.num_tool_calls) == (2, "max_turns", 1)


def test_rollout_agent_tool_time_s_ends_a_trajectory_after_its_tools():
    t = _run(["rollout.agent.tool_time_s=1e-9"])  # the first call's seconds exceed it
    assert (t.num_turns, t.stop_reason, t.num_tool_calls) == (1, "tool_time", 1)


def test_rollout_agent_response_length_is_the_span_of_all_turns():
    # call (6) + observation <tool>3<eos><assistant> (4) = 10 per round: 24 tokens leave room for 2 rounds
    t = _run(["rollout.agent.max_turns=5", "rollout.response_length=24"])
    assert t.stop_reason == "length" and len(t.response_ids) <= 24 and t.num_turns == 3


def _prompts():
    raw = np.empty(2, dtype=object)
    raw[:] = [[{"role": "user", "content": "1+2="}], [{"role": "user", "content": "3+4="}]]
    extra = np.array([{"tools_kwargs": {"calculator": {}}}] * 2, dtype=object)
    return DataProto.from_dict({"input_ids": torch.ones(2, 3, dtype=torch.long),
                                "attention_mask": torch.ones(2, 3, dtype=torch.long)},
                               {"raw_prompt": raw, "extra_info": extra, "data_source": np.array(["a", "b"], dtype=object)})


@pytest.mark.parametrize("enabled", [False, True])
def test_rollout_agent_enabled_sends_the_rows_messages_and_tools(enabled):
    cfg = load_config("tiny_tool_grpo", [f"rollout.agent.enabled={str(enabled).lower()}"])
    _, gen_in = generation_request(_prompts(), 2, {"seed": 1}, agent_input_keys(cfg))
    expected = ["extra_info", "raw_prompt"] if enabled else []
    assert sorted(gen_in.non_tensor_batch) == expected
    for proxy in (ActorProxy, RolloutProxy):
        sent = inputs_for(proxy.generate_sequences, gen_in)
        assert sorted(sent.non_tensor_batch) == expected
    if enabled:
        assert [m[0]["content"] for m in gen_in.non_tensor_batch["raw_prompt"]] == ["1+2="] * 2 + ["3+4="] * 2


def _trajectory(turns, calls, obs, length):
    return Trajectory(prompt_ids=[1, 2], response_ids=[7] * length, response_mask=[1] * length,
                      log_probs=[-0.5] * length, num_turns=turns, num_observation_tokens=obs,
                      calls=[ToolCallRecord(*c) for c in calls], stop_reason="answer" if turns < 3 else "max_turns")


class _Out:
    """A generate call's result: the concatenated rows and the per-replica metrics."""

    def __init__(self, batch, metrics):
        self.batch, self.metrics = batch, metrics


def test_the_join_computes_agent_metrics_over_every_replicas_rows():
    replicas = [[_trajectory(2, [("calculator", None, 0.25)], 4, 10), _trajectory(1, [], 0, 3)],
                [_trajectory(3, [("calculator", "bad_expression", 0.5), ("", "malformed", 0.0)], 8, 16),
                 _trajectory(1, [], 0, 2)]]
    parts = []
    for trajectories in replicas:
        tensors, counts = assemble_agent_batch(trajectories, response_length=16, pad_token_id=0, prompt_length=4)
        parts.append(DataProto.from_dict(tensors, counts))
    rows = DataProto.concat(parts)
    prompts = DataProto.from_dict({"input_ids": torch.ones(4, 4, dtype=torch.long)},
                                  {"uid": np.array(list("abcd"), dtype=object)})
    batch, metrics = join_rollout(prompts, _Out(rows, [{"rollout/weight_version": 1.0}] * 2), 1)
    expected = trajectory_metrics([t for ts in replicas for t in ts])
    assert {k: v for k, v in metrics.items() if k.startswith("agent/")} == pytest.approx(expected)
    assert metrics["agent/turns/mean"] == 7 / 4 and metrics["agent/tool_errors/calculator"] == 1
    assert metrics["agent/observation_token_share"] == pytest.approx(12 / 31)
    assert metrics["rollout/weight_version"] == 1.0 and list(batch.non_tensor_batch["uid"]) == list("abcd")


def test_validation_trajectories_are_written_as_marked_text(tmp_path):
    t = _trajectory(2, [("calculator", None, 0.1)], 4, 6)
    t.messages = [{"role": "user", "content": "1+2="}, {"role": "assistant", "content": "<tool_call>...</tool_call>"},
                  {"role": "tool", "name": "calculator", "content": "3"}, {"role": "assistant", "content": "3"}]
    from megaflow.agent.metrics import render_trajectory

    tensors, counts = assemble_agent_batch([t, t, t], response_length=8, pad_token_id=0)
    counts["agent_text"] = np.array([render_trajectory(t)] * 3, dtype=object)
    counts["uid"] = np.array(["a", "a", "b"], dtype=object)
    tensors["token_level_scores"] = torch.tensor([[0.0] * 7 + [1.0], [0.0] * 8, [0.5] + [0.0] * 7])
    path = tmp_path / "agent_trajectories.txt"
    assert write_trajectories(DataProto.from_dict(tensors, counts), path, step=5, split="val", count=3) == 2
    text = path.read_text()
    assert text.count("===== step 5 val row") == 2 and "row 0, reward 1\n" in text and "row 2, reward 0.5\n" in text
    assert "[tool calculator]\n3\n[assistant]\n3\n[end: answer; 2 turns, 1 tool calls, 0 errors]" in text
    single = DataProto.from_dict({k: v for k, v in tensors.items()}, {"uid": counts["uid"]})
    assert write_trajectories(single, path, step=6, split="val", count=3) == 0
