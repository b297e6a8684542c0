"""Bad input that used to fail with a misleading or multi-line message, refused at load on
one line naming the key, the file or the override: a recipe or override that is not valid
YAML, and an error about a command-line override (tagged ``[override K=V]``, not ``[recipe ...]``)."""
from __future__ import annotations

import pytest

import tests.test_bad_input_table as table
from megaflow.config import ConfigError
from megaflow.topology import load_run
from tests.test_bad_input_table import model_dir  # noqa: F401  (the fixture the row runner takes)


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
