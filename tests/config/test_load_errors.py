"""Bad input that used to fail late or with a misleading or multi-line message, refused at
load on one line naming the key, the file or the override: an ``algorithm.filter_groups.metric``
that no reward of the run gives, a recipe or override that is not valid YAML, and an error
about a command-line override (tagged ``[override K=V]``, not ``[recipe ...]``)."""
from __future__ import annotations

from typing import get_args

import pytest

import tests.test_bad_input_table as table
from megaflow.config import ConfigError, config_to_dict
from megaflow.config.schema import BUILTIN_REWARD_PARTS, TASK_DATA_SOURCES, DataConfig
from megaflow.topology import load_run, run_from_dict
from tests.test_bad_input_table import model_dir  # noqa: F401  (the fixture the row runner takes)

FILTER = ["algorithm.filter_groups.enable=true"]
FILES = ["data.task=null", "data.train_files=[prompts.jsonl]"]  # read only by the pre-start checks


# ----------------------------------------------------------------- algorithm.filter_groups.metric
@pytest.mark.parametrize("source, responses, truth, extra", [
    ("openai/gsm8k", ["", "#### 72", "#### 5", "The answer is 72."], "72", None),
    ("gsm8k", ["", "#### 72"], "72", None),
    ("arith", ["", "3<eos>", "4<eos>", "x<eos>"], "3", None),
    ("countdown", ["", "<answer>1+2</answer>", "<answer>2*1</answer>", "<answer>1+1+2</answer>"],
     {"target": 3, "numbers": [1, 2]}, None),
    ("tool_arith", ["", "1+2<eos>3<eos>", "<tool_call>x</tool_call><eos>3<eos>"], 3, {"a": 1, "b": 2, "op": "+"}),
])
def test_the_declared_parts_are_what_each_built_in_scorer_returns(source, responses, truth, extra):
    from megaflow.rewards import compute_score

    for response in responses:
        out = compute_score(source, response, truth, extra)
        assert set(out) == {"score", *BUILTIN_REWARD_PARTS[source]}, (source, response)


def test_every_built_in_source_and_task_is_declared():
    from megaflow.data.arith import ARITH_DATA_SOURCE
    from megaflow.data.tool_arith import TOOL_ARITH_DATA_SOURCE
    from megaflow.rewards.registry import RewardTable

    assert {s for s in RewardTable.registered().sources() if not s.startswith("test/")} == set(BUILTIN_REWARD_PARTS)
    assert set(TASK_DATA_SOURCES) == set(_task_choices())
    assert TASK_DATA_SOURCES == {"arith": ARITH_DATA_SOURCE, "tool_arith": TOOL_ARITH_DATA_SOURCE}


def _task_choices() -> tuple[str, ...]:
    import typing

    hint = typing.get_type_hints(DataConfig)["task"]  # Literal[...] | None
    return tuple(a for arg in get_args(hint) for a in get_args(arg))


@pytest.mark.parametrize("overrides, metric", [
    ([], "acc"), ([], "format"), ([], "score"),
    (FILES, "tool_call"), (FILES, "format"),  # prompt files: any built-in source's part
    (["reward.functions.arith=my.module:score"], "anything"),  # the task's scorer is user code
    (["reward.format_weight=0.1", "data.task=tool_arith", "rollout.agent.enabled=true",
      "model.tokenizer=tool_arith"], "format"),  # the format reward adds 'format' to every scorer
])
def test_a_metric_some_reward_of_the_run_gives_loads(overrides, metric):
    cfg = load_run("tiny_arith_grpo", [*FILTER, *overrides, f"algorithm.filter_groups.metric={metric}"])
    assert cfg.algorithm.filter_groups.metric == metric


@pytest.mark.parametrize("overrides, metric, says", [
    ([], "foo", "'foo' is no value this run's rewards give; they give 'score' (the sequence reward) and, by data "
                "source (data.task=arith), 'acc' (arith), 'format' (arith) "
                "[override algorithm.filter_groups.metric=foo]"),
    ([], "accc", "'accc' is no value this run's rewards give (did you mean 'acc'?)"),
    ([], "tool_call", "'acc' (arith), 'format' (arith) ["),  # tool_arith's part, not arith's
    (["reward.format_weight=0.1"], "foo", "'format' (arith, reward.format_weight > 0)"),
    (FILES, "foo", "by data source (data.train_files: any built-in data source, the files are read after load), "
                   "'acc' (openai/gsm8k, gsm8k, arith, countdown, tool_arith), 'format' (arith), 'tool_call' "
                   "(tool_arith), 'tool_correct' (tool_arith) [override algorithm.filter_groups.metric=foo]"),
    (["reward.functions.countdown=my.module:score"], "foo", "'acc' (arith), 'format' (arith)"),  # not the task's
])
def test_a_metric_no_reward_of_the_run_gives_is_refused_at_load(overrides, metric, says):
    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", [*FILTER, *overrides, f"algorithm.filter_groups.metric={metric}"])
    assert err.value.key == "algorithm.filter_groups.metric" and says in str(err.value)
    assert "\n" not in str(err.value)


def test_the_metric_of_a_config_tree_is_checked_only_with_dynamic_sampling_on():
    tree = config_to_dict(load_run("tiny_arith_grpo"))
    tree["algorithm"]["filter_groups"]["metric"] = "foo"
    assert run_from_dict(tree).algorithm.filter_groups.metric == "foo"  # off: nothing reads it
    tree["algorithm"]["filter_groups"]["enable"] = True
    with pytest.raises(ConfigError, match=r"^algorithm\.filter_groups\.metric: 'foo' is no value"):
        run_from_dict(tree)  # a checkpoint's config.yaml


# ----------------------------------------------------------------- YAML that does not parse
@pytest.mark.parametrize("text, says", [
    (b"trainer:\n  total_steps: 3\n  bad: [1, 2\nactor:\n  tp: 1\n",
     "invalid YAML at line 4, column 6: expected ',' or ']', but got ':' (while parsing a flow sequence at line 3, "
     "column 8)"),
    (b"trainer:\n\ttotal_steps: 3\n", "invalid YAML at line 2, column 1: found character '\\t' that cannot start any "
                                     "token (while scanning for the next token)"),
    (b"trainer: total_steps: 3\n", "invalid YAML at line 1, column 21: mapping values are not allowed here"),
    (b"trainer:\n  total_steps: 3\x00\n", "invalid YAML at line 2, column 17: unacceptable character #x0000: "
                                          "special characters are not allowed"),
    (b"trainer:\n  experiment_name: caf\xe9\n", "not UTF-8 text: byte 0xe9 at offset 31 (invalid continuation byte)"),
])
def test_a_recipe_that_does_not_parse_is_one_line_naming_file_line_and_column(text, says, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as err:
        load_run(path)
    assert str(err.value) == f"{path}: {says}"


@pytest.mark.parametrize("override, says", [
    ("trainer.total_steps=[1", "trainer.total_steps: override value '[1' is not valid YAML at column 3: expected "
                               "',' or ']', but got '<stream end>' (while parsing a flow sequence at column 1)"),
    ("reward.reward_kwargs={arith: {a: 1}", "reward.reward_kwargs: override value '{arith: {a: 1}' is not valid "
                                            "YAML at column 15: expected ',' or '}', but got '<stream end>' (while "
                                            "parsing a flow mapping at column 1)"),
    ("trainer.total_steps=*x", "trainer.total_steps: override value '*x' is not valid YAML at column 1: found "
                               "undefined alias 'x'"),
])
def test_an_override_that_does_not_parse_is_one_line_naming_the_column(override, says):
    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", [override])
    assert str(err.value) == says


# ----------------------------------------------------------------- which input an error is about
RECIPE = str(table.REPO / "recipes" / "tiny_arith_grpo.yaml")


@pytest.mark.parametrize("overrides, tag", [
    (["trainer.total_step=3"], "[override trainer.total_step=3]"),  # an unknown key
    (["actor.tp=2", "actor.tp=3"], "[override actor.tp=3]"),  # across sections; the last one wins
    (["trainer.total_steps=a: b"], "[override trainer.total_steps=a: b]"),  # a mapping over a number replaces it
    (["actor.optim={lr: -1}"], "[override actor.optim={lr: -1}]"),  # a key inside a mapping override
    (["model.hf_config.num_attention_heads=3"], "[override model.hf_config.num_attention_heads=3]"),
    # The recipe's value is refused, or it takes part: both are named.
    (["data.train_files=[a.jsonl]"], f"[override data.train_files=[a.jsonl]; recipe {RECIPE}]"),
    (["trainer.total_steps.x=1"], f"[override trainer.total_steps.x=1; recipe {RECIPE}]"),
    (["trainer.total_steps=3", "trainer.total_steps.x=1"],
     "[override trainer.total_steps=3; override trainer.total_steps.x=1]"),
    (["algorithm.adv_estimator=gae"], f"[recipe {RECIPE}]"),  # about critic.enabled, which the recipe sets
])
def test_an_error_names_the_input_that_set_its_key(overrides, tag):
    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", overrides)
    assert str(err.value).endswith(f" {tag}")


# ----------------------------------------------------------------- through the command line
#: The README rows proposed for these refusals (the test runs them as README's table does).
ROWS = [
    ("make train algorithm.filter_groups.enable=true algorithm.filter_groups.metric=foo",
     "algorithm.filter_groups.metric: 'foo' is no value this run's rewards give; they give 'score'"),
    ("make train RECIPE=<recipe with an unclosed [>",
     "unclosed.yaml: invalid YAML at line 48, column 17: expected ',' or ']', but got ':'"),
    ("make train actor.tp=3", "world size must be tp*pp*cp*dp exactly [override actor.tp=3]"),
]


def _unclosed(tmp, model) -> str:
    return table._recipe_with(tmp, "unclosed", "    lr: 1.0e-3\n", "    lr: [1.0e-3\n")


@pytest.mark.parametrize("command, expected", ROWS, ids=[r[0] for r in ROWS])
def test_refused_through_the_command_line_on_one_line(command, expected, tmp_path, model_dir, capsys,  # noqa: F811
                                                      monkeypatch):
    monkeypatch.setitem(table.FIXTURES, "<recipe with an unclosed [>", _unclosed)
    table.test_bad_input_row(command, "", expected, tmp_path, model_dir, capsys, monkeypatch)
