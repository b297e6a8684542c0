"""The tiny agent task: its tokenizer (call tokens that decode to a Hermes call, an error
observation as one token, every sample encoding back to its ids), its rows and its reward."""
import random

import pytest

from megaflow.agent import ChatRenderer, ToolCall, check_rows, parse_tool_calls
from megaflow.data.tool_arith import CALL_CLOSE, CALL_OPEN, build_tool_arith_tokenizer, make_tool_arith_row
from megaflow.rewards.tool_arith import compute_score


@pytest.fixture(scope="module")
def tok():
    return build_tool_arith_tokenizer()


def test_vocabulary_and_round_trip(tok):
    assert len(tok) == 19 and tok.pad_token_id == tok.eos_token_id == 0 and tok.unk_token == "<error>"
    rng = random.Random(0)
    for _ in range(500):
        ids = [rng.randrange(19) for _ in range(16)]
        assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids


def test_the_call_tokens_write_a_hermes_call(tok):
    ids = tok.convert_tokens_to_ids([CALL_OPEN, "4", "7", "+", "8", "5", CALL_CLOSE])
    assert parse_tool_calls(tok.decode(ids)) == [ToolCall("calculator", {"expression": "47+85"})]


def test_the_template_renders_prompts_and_observations(tok):
    renderer = ChatRenderer(tok, tok.eos_token)
    assert renderer.appends
    prompt = renderer.prompt_ids([{"role": "user", "content": "47+85="}], [{"type": "function"}])
    assert tok.convert_ids_to_tokens(prompt) == ["<user>", "4", "7", "+", "8", "5", "=", "<eos>", "<assistant>"]
    assert tok.convert_ids_to_tokens(renderer.observation_ids([("calculator", "132")])) == \
        ["<tool>", "1", "3", "2", "<eos>", "<assistant>"]
    error = renderer.observation_ids([("", "Error: malformed tool call: the call has no closing </tool_call>")])
    assert tok.convert_ids_to_tokens(error) == ["<tool>", "<error>", "<eos>", "<assistant>"]


def test_rows_name_the_calculator():
    row = make_tool_arith_row(47, "+", 85, split="train", index=3)
    assert row["reward_model"]["ground_truth"] == "132" and row["data_source"] == "tool_arith"
    assert row["extra_info"]["tools_kwargs"] == {"calculator": {"create_kwargs": {}}}
    check_rows([{"prompt": row["prompt"], "extra_info": row["extra_info"]}])


INFO = {"a": 123, "b": 312, "op": "+"}
# The correct call's 9 tokens: <call> 1 2 3 + 3 1 2 <end_call>; the shaping tier is 0.5 x (tokens equal
# at the same position) / (the longer length), counted by hand below.


@pytest.mark.parametrize("text,score,acc,correct,call", [
    (f"{CALL_OPEN}123+312{CALL_CLOSE}<eos>435<eos>", 1.0, 1, 1, 1),
    (f"{CALL_OPEN}312+123{CALL_CLOSE}<eos>43<eos>", 0.6 + 0.3 * 2 / 3, 0, 1, 1),  # same value; "43" vs "435": 2 of 3
    (f"{CALL_OPEN}123+312{CALL_CLOSE}<eos>453<eos>", 0.6 + 0.3 * 1 / 3, 0, 1, 1),  # only the 4 in place
    (f"{CALL_OPEN}123+312{CALL_CLOSE}<eos>", 0.6, 0, 1, 1),  # the answer turn was cut off
    (f"{CALL_OPEN}123+31{CALL_CLOSE}<eos>43<eos>", 0.5 * 7 / 9, 0, 0, 1),  # <call>123+31 in place, then 8 vs 9 tokens
    (f"{CALL_OPEN}111+111{CALL_CLOSE}<eos>", 0.5 * 5 / 9, 0, 0, 1),  # <call>, 1, +, 1, <end_call>: no better than chance
    (f"{CALL_OPEN}{CALL_CLOSE}<eos>", 0.5 * 1 / 9, 0, 0, 1),  # an empty call: only <call> in place
    (f"{CALL_OPEN}99{CALL_CLOSE}{CALL_OPEN}99{CALL_CLOSE}<eos>", 0.5 * 1 / 9, 0, 0, 0),  # two calls in the turn
    ("435<eos>", 0.0, 0, 0, 0),  # the answer without the tool
    (f"{CALL_OPEN}123+312{CALL_CLOSE}", 0.5, 0, 0, 0),  # the turn never ended: the loop ran no call
])
def test_reward_table_by_hand(text, score, acc, correct, call):
    got = compute_score(text, "435", INFO)
    assert got == pytest.approx({"score": score, "acc": acc, "tool_correct": correct, "tool_call": call})
