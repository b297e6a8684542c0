"""The agent loop on a scripted engine: ids appended turn by turn, observations from the chat
template, limits, a waiting tool not stalling the others, the TP broadcast, and the batch."""
import queue
import threading

import pytest
import torch

from agent_testlib import BAD_CALL, CALL, IM_END, PAD, STRIPPING_TEMPLATE, ids, word_tokenizer
from megaflow.agent import (
    EnvStep, Observation, ToolEnvironment, register_environment, unregister_environment,
)
from megaflow.agent.batch import assemble_agent_batch
from megaflow.agent.loop import AgentLimits, AgentLoop, AgentLoopError
from megaflow.agent.template import ChatRenderer
from megaflow.protocol import DataProto
from megaflow.trainer.stages import check_rollout_batch

CALL_TURN = ids("<tool_call>", CALL, "</tool_call>", "<|im_end|>")
ANSWER_TURN = ids("answer", "3", "<|im_end|>")
# what the template renders after an assistant turn's <|im_end|> for a calculator answer "3"
# (the newline is dropped by the whitespace tokenizer)
OBS_3 = ids("<|im_start|>", "tool", "3", "<|im_end|>", "<|im_start|>", "assistant")


class ScriptedEngine:
    """Turn t of trajectory i samples ``scripts[i][t]`` (cut at the request's budget) after
    ``delay`` engine steps; log-prob of the k-th token of a turn: -(k + 1) / 10."""

    def __init__(self, scripts, delay=2, on_finish=None):
        self.scripts, self.delay, self.on_finish = scripts, delay, on_finish
        self.running, self.requests, self.turns = {}, [], {}

    def add(self, key, request):
        turn = self.turns.get(request.index, 0)
        self.turns[request.index] = turn + 1
        sampled = self.scripts[request.index][turn][:request.max_tokens]
        self.requests.append(request)
        self.running[key] = [self.delay, sampled, [-(k + 1) / 10 for k in range(len(sampled))], request.index, turn]

    def abort_all(self):
        self.running.clear()

    def step(self):
        done = []
        for key, state in list(self.running.items()):
            state[0] -= 1
            if state[0] <= 0:
                del self.running[key]
                done.append((key, state[1], state[2]))
                if self.on_finish:
                    self.on_finish(state[3], state[4])
        return done


def _row(*tools):
    return {"prompt": [{"role": "user", "content": "what is 1+2 ?"}],
            "extra_info": {"tools_kwargs": {t: {} for t in tools}}}


def _loop(engine, limits=AgentLimits(max_turns=4, response_length=64), template=None, **kw):
    tok = word_tokenizer(template) if template else word_tokenizer()
    return AgentLoop(engine, ChatRenderer(tok, "<|im_end|>"), lambda t: tok.decode(t), limits,
                     eos_token_ids=[IM_END], max_model_len=256, **kw), tok


def test_each_turn_appends_sampled_and_observation_ids():
    engine = ScriptedEngine([[CALL_TURN, ANSWER_TURN]])
    loop, tok = _loop(engine)
    (t,) = loop.run([_row("calculator")], seeds=[7])
    prompt = ids("<|im_start|>", "system", "tools:", "calculator", "<|im_end|>", "<|im_start|>", "user", "what", "is",
                 "1+2", "?", "<|im_end|>", "<|im_start|>", "assistant")
    assert t.prompt_ids == prompt
    assert [r.prompt_ids for r in engine.requests] == [prompt, prompt + CALL_TURN + OBS_3]
    assert t.response_ids == CALL_TURN + OBS_3 + ANSWER_TURN
    assert t.response_mask == [1] * 4 + [0] * 6 + [1] * 3
    assert t.log_probs == pytest.approx([-.1, -.2, -.3, -.4] + [0] * 6 + [-.1, -.2, -.3])
    assert (t.num_turns, t.num_tool_calls, t.num_tool_errors, t.num_observation_tokens) == (2, 1, 0, 6)
    assert t.stop_reason == "answer" and t.template_ok
    assert t.messages[-2] == {"role": "tool", "name": "calculator", "content": "3"}
    assert engine.requests[1].seed != engine.requests[0].seed


def test_errors_become_observations_and_are_counted():
    bad = ids("<tool_call>", BAD_CALL, "</tool_call>", "<|im_end|>")
    engine = ScriptedEngine([[bad, CALL_TURN, ANSWER_TURN], [CALL_TURN, ANSWER_TURN]])
    loop, tok = _loop(engine)
    malformed, unknown = loop.run([_row("calculator"), _row()], seeds=[1, 2])
    assert malformed.calls[0].error == "malformed" and malformed.messages[2]["content"].startswith("Error: malformed")
    assert (malformed.num_tool_calls, malformed.num_tool_errors, malformed.stop_reason) == (2, 1, "answer")
    assert unknown.calls[0].error == "unknown_tool" and unknown.template_ok and malformed.template_ok


def test_limits_end_trajectories_and_say_why():
    always_call = [CALL_TURN] * 10
    no_eos = [ids("answer", "answer", "answer", "answer", "answer")]
    engine = ScriptedEngine([always_call, always_call, no_eos])
    loop, _ = _loop(engine, AgentLimits(max_turns=3, response_length=64))
    turns, _, _ = loop.run([_row("calculator")] * 3, seeds=[1, 2, 3])
    assert (turns.stop_reason, turns.num_turns, turns.num_tool_calls) == ("max_turns", 3, 2)
    engine = ScriptedEngine([always_call, no_eos])
    loop, _ = _loop(engine, AgentLimits(max_turns=10, response_length=25))
    budget, cut = loop.run([_row("calculator"), _row()], seeds=[1, 2])
    assert budget.stop_reason == "length" and len(budget.response_ids) <= 25
    assert cut.stop_reason == "length" and cut.num_turns == 1


class _WaitingEnv(ToolEnvironment):
    """The calculator environment, but a step returns only once ``release`` is set."""

    release = threading.Event()

    def step(self, calls):
        released = self.release.wait(timeout=60)
        return super().step(calls) if released else EnvStep([Observation("stalled", tool="calculator")])


@pytest.fixture
def waiting_env():
    _WaitingEnv.release.clear()
    register_environment("waiting")(_WaitingEnv)
    yield _WaitingEnv
    unregister_environment("waiting")


def test_a_waiting_tool_does_not_stall_other_trajectories(waiting_env):
    busy_script = [CALL_TURN, CALL_TURN, CALL_TURN, ANSWER_TURN]

    def on_finish(index, turn):  # trajectory 0's tool answers only once trajectory 1 has finished every turn
        if index == 1 and turn == len(busy_script) - 1:
            waiting_env.release.set()

    engine = ScriptedEngine([[CALL_TURN, ANSWER_TURN], busy_script], on_finish=on_finish)
    loop, _ = _loop(engine)
    waiting, busy = loop.run([{**_row("calculator"), "agent_name": "waiting"}, _row("calculator")], seeds=[1, 2])
    assert busy.num_turns == 4 and busy.stop_reason == "answer"
    assert waiting.num_turns == 2 and waiting.messages[2]["content"] == "3"  # not "stalled"
    order = [r.index for r in engine.requests]
    assert order == [0, 1, 1, 1, 1, 0]


def test_tool_time_limit(waiting_env):
    waiting_env.release.set()
    engine = ScriptedEngine([[CALL_TURN, ANSWER_TURN]])
    loop, _ = _loop(engine, AgentLimits(tool_time_s=1e-9))
    (t,) = loop.run([_row("calculator")], seeds=[1])
    assert t.stop_reason == "tool_time" and t.num_turns == 1 and t.num_tool_calls == 1


def test_template_that_rewrites_earlier_turns_is_counted_not_followed():
    engine = ScriptedEngine([[CALL_TURN, ANSWER_TURN], [ANSWER_TURN]])
    loop, _ = _loop(engine, template=STRIPPING_TEMPLATE)
    multi, single = loop.run([_row("calculator")] * 2, seeds=[1, 2])
    assert multi.response_ids == CALL_TURN + OBS_3 + ANSWER_TURN  # the ids the engine saw, appended
    assert not multi.template_ok and single.template_ok


def test_tp_ranks_get_the_same_requests_and_trajectories():
    to_rank1 = queue.Queue()

    def send(obj):
        to_rank1.put(obj)
        return obj

    scripts = [[CALL_TURN, ANSWER_TURN], [ANSWER_TURN], [CALL_TURN, CALL_TURN, ANSWER_TURN]]
    engines = [ScriptedEngine(scripts), ScriptedEngine(scripts)]
    rank0, _ = _loop(engines[0], broadcast=send)
    rank1 = AgentLoop(engines[1], None, None, AgentLimits(), eos_token_ids=[IM_END], max_model_len=256,
                      is_tool_rank=False, broadcast=lambda obj: to_rank1.get(timeout=60))
    results = {}
    follower = threading.Thread(target=lambda: results.setdefault(1, rank1.run([None] * 3, seeds=[0] * 3)))
    follower.start()
    results[0] = rank0.run([_row("calculator")] * 3, seeds=[4, 5, 6])
    follower.join(timeout=60)
    assert engines[1].requests == engines[0].requests and len(engines[0].requests) == 6
    assert [t.response_ids for t in results[1]] == [t.response_ids for t in results[0]]


def test_a_tool_rank_failure_is_raised_on_every_rank():
    to_rank1 = queue.Queue()

    def send(obj):
        to_rank1.put(obj)
        return obj

    rank0, _ = _loop(ScriptedEngine([[ANSWER_TURN]]), broadcast=send)
    rank1 = AgentLoop(ScriptedEngine([[ANSWER_TURN]]), None, None, AgentLimits(), eos_token_ids=[IM_END],
                      max_model_len=256, is_tool_rank=False, broadcast=lambda obj: to_rank1.get(timeout=60))
    errors = {}

    def follow():
        try:
            rank1.run([None], seeds=[0])
        except AgentLoopError as e:
            errors[1] = str(e)

    follower = threading.Thread(target=follow)
    follower.start()
    with pytest.raises(AgentLoopError, match="unknown tool 'search'"):
        rank0.run([_row("search")], seeds=[1])
    follower.join(timeout=60)
    assert "unknown tool 'search'" in errors[1]
    to_rank1.queue.clear()
    engine = ScriptedEngine([[CALL_TURN, ANSWER_TURN], [ANSWER_TURN]])
    add = engine.add

    def add_slow_second(key, request):  # trajectory 1 is still decoding when trajectory 0's tool answers
        add(key, request)
        if request.index == 1:
            engine.running[key][0] = 10 ** 9

    engine.add = add_slow_second
    broken, _ = _loop(engine)
    broken.renderer.observation_ids = lambda observations: 1 / 0  # fails once a tool answered
    with pytest.raises(AgentLoopError, match="ZeroDivisionError"):
        broken.run([_row("calculator")] * 2, seeds=[1, 2])
    assert engine.running == {}  # the engine holds no request of the failed run


def test_batch_rows_masks_and_counts():
    engine = ScriptedEngine([[CALL_TURN, ANSWER_TURN], [ANSWER_TURN]])
    loop, _ = _loop(engine)
    trajectories = loop.run([_row("calculator"), _row()], seeds=[1, 2])
    tensors, counts = assemble_agent_batch(trajectories, response_length=16, pad_token_id=PAD)
    first, second = trajectories
    assert tensors["responses"][0].tolist() == CALL_TURN + OBS_3 + ANSWER_TURN + [PAD] * 3
    assert tensors["response_mask"][0].tolist() == [1] * 4 + [0] * 6 + [1] * 3 + [0] * 3
    assert tensors["response_mask"][1].tolist() == [1] * 3 + [0] * 13
    width = len(first.prompt_ids)  # the longer prompt (it lists the tools)
    assert tensors["attention_mask"][0].tolist() == [1] * width + [1] * 13 + [0] * 3  # observations attended
    assert tensors["prompts"][1].tolist() == [PAD] * (width - len(second.prompt_ids)) + second.prompt_ids
    expected = torch.tensor([-.1, -.2, -.3, -.4] + [0] * 6 + [-.1, -.2, -.3] + [0] * 3)
    assert torch.allclose(tensors["rollout_log_probs"][0], expected)
    assert counts["agent_turns"].tolist() == [2, 1] and counts["agent_tool_calls"].tolist() == [1, 0]
    assert counts["agent_observation_tokens"].tolist() == [6, 0]
    assert counts["agent_stop_reason"].tolist() == ["answer", "answer"]
    check_rollout_batch(DataProto.from_dict(tensors))  # the trainer's batch check accepts the holes
