"""Recipes, command-line overrides, YAML round trips."""
import pytest
import yaml

from megaflow.config import ConfigError, dump_config, list_recipes
from megaflow.dryrun import build_plan, format_plan

from megaflow.config.loader import apply_override, parse_override
from megaflow.topology import load_run, run_from_dict

SHIPPED = ["tiny_arith_grpo", "smollm2_gsm8k_grpo", "llama70b_ppo", "qwen25_7b_gsm8k_grpo", "llama3_8b_ppo"]


def test_the_promised_recipes_are_shipped():
    assert set(SHIPPED) <= set(list_recipes())


@pytest.mark.parametrize("name", list_recipes())
def test_every_recipe_loads_and_its_dry_run_fits(name):
    cfg = load_run(name)
    assert cfg.trainer.experiment_name == name
    plan = build_plan(cfg)
    text = format_plan(plan)
    assert plan.fits, text
    for fragment in (f"megaflow dry run: {name}", "pools", "actor (pool", "tp groups", "dp groups", "pp groups",
                     "rollout (in the actor's processes)", "micro-dp groups", "memory per rank by phase", "fits"):
        assert fragment in text, fragment


def test_default_recipe_layout_is_the_promised_one():
    cfg = load_run("tiny_arith_grpo")
    assert cfg.model.hf_config["model_type"] == "llama" and cfg.model.tokenizer == "arith"
    assert cfg.actor.tp * cfg.actor.pp == 2 and cfg.resources.procs_per_node == 2
    assert cfg.rollout.engine == "vllm" and cfg.algorithm.adv_estimator == "grpo"
    assert cfg.resources.use_gpu is False


@pytest.mark.parametrize("item, key, value", [
    ("trainer.total_steps=3", "trainer.total_steps", 3),
    ("actor.optim.lr=1e-5", "actor.optim.lr", "1e-5"),       # YAML 1.1: a string, coerced later
    ("actor.optim.lr=0.001", "actor.optim.lr", 0.001),
    ("ref.enabled=true", "ref.enabled", True),
    ("trainer.total_steps=null", "trainer.total_steps", None),
    ("trainer.logger=[console,wandb]", "trainer.logger", ["console", "wandb"]),
    ("model.path=/models/x", "model.path", "/models/x"),
    ("data.val_batch_size=null", "data.val_batch_size", None),
    ("trainer.project_name=''", "trainer.project_name", ""),
])
def test_override_values_are_typed_as_yaml(item, key, value):
    assert parse_override(item) == (key, value)


@pytest.mark.parametrize("item", ["trainer.total_steps=", "trainer.total_steps=  "])
def test_empty_override_value_is_an_error_not_null(item):
    with pytest.raises(ConfigError, match=r"trainer.total_steps: override .* has no value; write "
                                          r"trainer.total_steps=null for null"):
        parse_override(item)


def test_mapping_override_merges_key_by_key():
    recipe = load_run("tiny_arith_grpo")
    cfg = load_run("tiny_arith_grpo", ["model.hf_config={num_hidden_layers: 4, rope_theta: 500.0}"])
    expected = {**dict(recipe.model.hf_config), "num_hidden_layers": 4, "rope_theta": 500.0}
    assert dict(cfg.model.hf_config) == expected
    tree = apply_override({"a": {"b": 1, "c": {"d": 2, "e": 3}}}, "a", {"c": {"d": 5}})
    assert tree == {"a": {"b": 1, "c": {"d": 5, "e": 3}}}
    assert apply_override({"a": {"b": 1}}, "a.b", [1, 2]) == {"a": {"b": [1, 2]}}  # non-mappings replace


@pytest.mark.parametrize("value", [".inf", "-.inf", ".nan", "nan", "1e999"])
def test_non_finite_float_is_refused(value):
    with pytest.raises(ConfigError, match="actor.optim.lr: must be a finite number"):
        load_run("tiny_arith_grpo", [f"actor.optim.lr={value}"])


@pytest.mark.parametrize("text, key, lines", [
    ("actor:\n  optim:\n    lr: 1.0e-3\n    lr: 2.0e-3\n", "actor.optim.lr", (3, 4)),
    ("trainer:\n  total_steps: 3\nactor: {tp: 2}\ntrainer:\n  total_steps: 5\n", "trainer", (1, 4)),
    ("resources:\n  pools:\n    - {a: 1, a: 2}\n", "resources.pools[0].a", (3, 3)),
])
def test_duplicate_recipe_key_is_named_with_its_lines(tmp_path, text, key, lines):
    path = tmp_path / "dup.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_run(path)
    assert str(err.value) == (f"{key}: given twice in {path} (lines {lines[0]} and {lines[1]}); "
                              "YAML would keep only the second: remove one")


def test_yaml_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("model:\n  hf_config: &base {model_type: llama, hidden_size: 64}\n"
                    "reward_model:\n  hf_config:\n    <<: *base\n    hidden_size: 32\n")
    from megaflow.config.loader import read_yaml

    assert read_yaml(path)["reward_model"]["hf_config"] == {"model_type": "llama", "hidden_size": 32}


@pytest.mark.parametrize("item", ["trainer.total_steps", "=3", "trainer..x=1", "a b=1"])
def test_malformed_override_is_rejected(item):
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        parse_override(item)


def test_overrides_apply_in_order_over_the_recipe():
    cfg = load_run("tiny_arith_grpo", ["trainer.total_steps=3", "actor.optim.lr=1e-5",
                                       "model.hf_config.num_hidden_layers=4", "trainer.total_steps=5"])
    assert cfg.trainer.total_steps == 5 and cfg.actor.optim.lr == 1e-5
    assert cfg.model.hf_config["num_hidden_layers"] == 4 and cfg.model.hf_config["hidden_size"] == 128


def test_override_inside_a_scalar_is_rejected():
    with pytest.raises(ConfigError, match=r"^actor\.tp: is 2, not a section"):
        apply_override({"actor": {"tp": 2}}, "actor.tp.x", 1)


def test_unknown_override_key_suggests_and_names_the_override():
    with pytest.raises(ConfigError) as err:
        load_run("tiny_arith_grpo", ["trainer.total_step=3"])
    msg = str(err.value)
    assert msg.startswith("trainer.total_step: unknown key; did you mean trainer.total_steps")
    assert msg.endswith(" [override trainer.total_step=3]")  # not the recipe, which does not hold it


def test_wrong_type_override_names_key_type_and_value():
    with pytest.raises(TypeError, match=r"^actor\.ppo_epochs: expected int, got str 'many'"):
        load_run("tiny_arith_grpo", ["actor.ppo_epochs=many"])


def test_unknown_recipe_suggests_a_shipped_one():
    with pytest.raises(FileNotFoundError, match="did you mean tiny_arith_grpo"):
        load_run("tiny_arith_grp")


def test_recipe_path_and_invalid_yaml(tmp_path):
    good = tmp_path / "mine.yaml"
    good.write_text(yaml.safe_dump({"model": {"hf_config": {"model_type": "llama", "hidden_size": 64,
                                                             "intermediate_size": 128, "num_hidden_layers": 2,
                                                             "num_attention_heads": 4, "vocab_size": 16},
                                              "tokenizer": "arith"},
                                    "data": {"task": "arith"}, "resources": {"use_gpu": False}}))
    assert load_run(good).trainer.experiment_name == "mine"
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: invalid YAML"):
        load_run(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_run(listy)


@pytest.mark.parametrize("name", ["tiny_arith_grpo", "llama70b_ppo"])
def test_dump_and_reload_round_trip(tmp_path, name):
    cfg = load_run(name, ["trainer.total_steps=7"])
    path = tmp_path / "config.yaml"
    text = dump_config(cfg, path)
    assert yaml.safe_load(text)["trainer"]["total_steps"] == 7
    again = load_run(path)
    assert again == cfg
    assert run_from_dict(yaml.safe_load(text)) == cfg


def test_the_loader_builds_and_load_run_validates_across_sections():
    """``load_config`` checks each section alone; the cross-section rules run in ``load_run``,
    whose error names the key and the recipe exactly as a section's error does."""
    from megaflow.config import load_config

    cfg = load_config("tiny_arith_grpo", ["algorithm.adv_estimator=gae"])  # needs a critic
    assert cfg.algorithm.adv_estimator == "gae" and not cfg.critic.enabled
    with pytest.raises(ConfigError, match=r"^critic\.enabled: adv_estimator 'gae' needs a critic: set "
                                          r"critic\.enabled=true \[recipe .*/tiny_arith_grpo\.yaml\]$"):
        load_run("tiny_arith_grpo", ["algorithm.adv_estimator=gae"])


@pytest.mark.parametrize("spelling", ["off", "Off", "OFF"])
def test_a_choice_yaml_reads_as_a_boolean_is_taken_as_spelled(spelling, tmp_path):
    # PyYAML (YAML 1.1) reads off/on/no/yes as booleans: `actor.router_replay=off` on the command
    # line and `router_replay: off` in a recipe both arrive as False.
    from megaflow.config import config_to_dict

    assert load_run("tiny_moe_grpo", [f"actor.router_replay={spelling}"]).actor.router_replay == "off"
    tree = config_to_dict(load_run("tiny_moe_grpo", []))
    tree["actor"]["router_replay"] = yaml.safe_load(spelling)
    assert tree["actor"]["router_replay"] is False
    assert run_from_dict(tree).actor.router_replay == "off"
    # A boolean where no choice is spelled like it is still refused, naming the choices.
    with pytest.raises(ConfigError, match=r"actor\.loss_agg_mode: invalid value True; expected one of"):
        load_run("tiny_moe_grpo", ["actor.loss_agg_mode=yes"])
