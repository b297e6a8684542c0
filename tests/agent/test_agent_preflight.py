"""rollout.agent at load: a template without a tool role, a row naming an unknown tool or
environment, a tool schema the parser cannot use, a first-turn prompt longer than
data.max_prompt_length: each refused by the preflight before any process starts, naming the
key and the file and row."""
import json

import pytest

from megaflow.agent import Tool, register_tool, unregister_tool
from megaflow.topology import load_run
from megaflow.trainer.main import main
from megaflow.trainer.preflight import PreflightError, preflight


def _rows(path, extra_infos):
    with open(path, "w") as f:
        for i, extra in enumerate(extra_infos):
            f.write(json.dumps({"data_source": "tool_arith", "prompt": [{"role": "user", "content": f"1{i}+22="}],
                                "reward_model": {"ground_truth": str(32 + i)}, "extra_info": extra}) + "\n")
    return str(path)


def _refusal(tmp_path, overrides, recipe="tiny_tool_grpo"):
    cfg = load_run(recipe, [f"trainer.output_dir={tmp_path}", *overrides])
    with pytest.raises(PreflightError) as info:
        preflight(cfg)
    return str(info.value)


def _files(tmp_path, bad_extra):
    good = {"tools_kwargs": {"calculator": {"create_kwargs": {}}}}
    train = _rows(tmp_path / "train.jsonl", [good, good, bad_extra] + [good] * 13)
    return ["data.task=null", f"data.train_files=[{train}]", "trainer.test_freq=0"]


def test_the_tiny_tool_recipe_passes(tmp_path):
    inputs = preflight(load_run("tiny_tool_grpo", [f"trainer.output_dir={tmp_path}", "data.task_args.num_train=40"]))
    inputs.discard_generated()
    assert len(inputs.train_dataset) == 40


def test_a_template_without_a_tool_role_is_refused(tmp_path):
    msg = _refusal(tmp_path, ["rollout.agent.enabled=true"], recipe="tiny_arith_grpo")
    assert "model.tokenizer: arith: rollout.agent.enabled needs a chat template with a tool role" in msg, msg


def test_an_unknown_tool_is_refused_naming_the_row(tmp_path):
    msg = _refusal(tmp_path, _files(tmp_path, {"tools_kwargs": {"calculater": {}}}))
    assert "data.train_files: " in msg and "train.jsonl, row 2 (line 3)" in msg and "unknown tool 'calculater'" in msg, msg


def test_an_unknown_environment_is_refused_naming_the_row(tmp_path):
    msg = _refusal(tmp_path, _files(tmp_path, {"agent_name": "chess", "tools_kwargs": {"calculator": {}}}))
    assert "train.jsonl, row 2 (line 3)" in msg and "unknown environment 'chess'" in msg, msg


def test_bad_create_kwargs_are_refused(tmp_path):
    msg = _refusal(tmp_path, _files(tmp_path, {"tools_kwargs": {"calculator": {"create_kwargs": {"digits": 3}}}}))
    assert "train.jsonl, row 2 (line 3)" in msg and "bad create_kwargs" in msg, msg


class _ArrayArgs(Tool):
    name, description = "array_args", "arguments that are not an object"
    parameters = {"type": "array"}

    def call(self, args):
        return ""


def test_a_schema_the_parser_cannot_use_is_refused(tmp_path):
    register_tool("array_args")(_ArrayArgs)
    try:
        msg = _refusal(tmp_path, _files(tmp_path, {"tools_kwargs": {"array_args": {}}}))
    finally:
        unregister_tool("array_args")
    assert "train.jsonl, row 2 (line 3)" in msg and "parameters must be a JSON schema of type 'object'" in msg, msg


def test_a_first_turn_prompt_over_max_prompt_length_is_refused(tmp_path):
    """A template that renders the tools (agent_testlib's ChatML): the dataset's prompt (no tools)
    fits, the first turn's (with the calculator's system line) does not."""
    from agent_testlib import word_tokenizer

    word_tokenizer().save_pretrained(tmp_path / "tok")
    overrides = _files(tmp_path, {"tools_kwargs": {"calculator": {}}}) + [
        f"model.tokenizer={tmp_path / 'tok'}", "model.hf_config.vocab_size=32", "data.max_prompt_length=8"]
    msg = _refusal(tmp_path, overrides)  # <|im_start|> user 10+22= <|im_end|> <|im_start|> assistant: 6 tokens
    assert "data.train_files: " in msg and "row 0 (line 1): the first-turn prompt with the row's tools has 11 " \
        "tokens, more than data.max_prompt_length=8" in msg, msg


def test_main_exits_2_without_a_traceback(tmp_path, capsys):
    rc = main(["--recipe", "tiny_arith_grpo", f"trainer.output_dir={tmp_path}", "rollout.agent.enabled=true"])
    err = capsys.readouterr().err
    assert rc == 2 and "model.tokenizer:" in err and "tool role" in err and "Traceback" not in err, err
