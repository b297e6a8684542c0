"""Sections, defaults, typing and the error messages of the config schema."""
import dataclasses

import pytest

from megaflow.config import Config, ConfigError, ConfigTypeError, schema
from megaflow.config.typed import Section
from megaflow.topology import run_from_dict, validate_config

SECTIONS = sorted({cls for mod in (schema,) for cls in vars(mod).values()
                   if isinstance(cls, type) and issubclass(cls, Section) and cls is not Section},
                  key=lambda c: c.__name__)
SECTIONS.remove(Config)


@pytest.mark.parametrize("cls", SECTIONS, ids=lambda c: c.__name__)
def test_every_section_default_is_valid_and_documented(cls):
    section = cls()
    assert dataclasses.is_dataclass(section)
    assert cls.__doc__, f"{cls.__name__} needs a docstring"
    source = __import__("inspect").getsource(cls)
    for name in cls.__dict__.get("__annotations__", {}):  # fields declared by this class
        # one attribute docstring per field, on the line after its declaration
        after = source.split(f"\n    {name}:", 1)[1].split("\n", 2)[1].strip()
        assert after.startswith('"""'), f"{cls.__name__}.{name} has no docstring"


def test_defaults_plus_required_inputs_are_valid(tiny):
    cfg = run_from_dict(tiny())
    assert cfg.actor.tp == 1 and cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 8
    assert cfg.resources.pools["global"].nodes is None  # the pool defaults to the whole cluster


def test_bare_defaults_name_the_required_model_key():
    cfg = Config()  # each section is valid on its own; the checks across sections refuse it
    with pytest.raises(ConfigError, match=r"^model\.path: set model\.path .* or model\.hf_config"):
        validate_config(cfg)


def test_no_training_data_is_named(tiny):
    tree = tiny()
    del tree["data"]["task"]
    with pytest.raises(ConfigError, match=r"data\.train_files: no training data: set data\.train_files or data\.task"):
        run_from_dict(tree)


def test_config_is_frozen_and_its_containers_immutable(tiny):
    cfg = run_from_dict(tiny(actor={"optim": {"betas": [0.9, 0.95]}}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.actor.tp = 2
    with pytest.raises(TypeError):
        cfg.model.hf_config["hidden_size"] = 1
    assert cfg.actor.optim.betas == (0.9, 0.95) and isinstance(cfg.actor.optim.betas, tuple)
    assert isinstance(cfg.trainer.logger, tuple)


def test_unknown_key_suggests_the_full_dotted_key(tiny):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(actor={"optim": {"lrr": 1e-5}}))
    assert err.value.key == "actor.optim.lrr"
    assert "did you mean actor.optim.lr?" in str(err.value)


def test_unknown_section_lists_close_matches(tiny):
    tree = tiny()
    tree["acter"] = {"tp": 2}
    with pytest.raises(ConfigError, match=r"^acter: unknown key; did you mean actor\?"):
        run_from_dict(tree)


def test_unknown_key_without_close_match_lists_valid_keys(tiny):
    with pytest.raises(ConfigError, match=r"^trainer\.zzz: unknown key; valid keys here: total_epochs, "):
        run_from_dict(tiny(trainer={"zzz": 1}))


@pytest.mark.parametrize("key, value, expected", [
    ("tp", "two", "expected int, got str 'two'"),
    ("tp", True, "expected int, got bool True"),
    ("tp", 2.5, "expected int, got float 2.5"),
    ("param_offload", "yes please", "expected bool, got str 'yes please'"),
    ("clip_ratio_c", [3], "expected float or null, got list [3]"),  # float | None
    ("use_distributed_optimizer", "maybe", "expected bool or null, got str 'maybe'"),  # bool | None
])
def test_wrong_type_names_key_expected_type_and_value(tiny, key, value, expected):
    with pytest.raises(ConfigTypeError) as err:
        run_from_dict(tiny(actor={key: value}))
    assert str(err.value).startswith(f"actor.{key}: ")
    assert expected in str(err.value)
    assert isinstance(err.value, TypeError) and isinstance(err.value, ValueError)


def test_float_fields_accept_ints_and_yaml_exponent_strings(tiny):
    cfg = run_from_dict(tiny(actor={"optim": {"lr": "1e-5", "weight_decay": 0}}))
    assert cfg.actor.optim.lr == 1e-5 and cfg.actor.optim.weight_decay == 0.0
    assert isinstance(cfg.actor.optim.weight_decay, float)


def test_invalid_choice_lists_choices_and_the_closest(tiny):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(algorithm={"adv_estimator": "grpoo"}))
    assert str(err.value).startswith("algorithm.adv_estimator: invalid value 'grpoo'; expected one of 'gae', ")
    assert "did you mean 'grpo'" in str(err.value)


def test_nested_section_default_is_the_layering_base(tiny):
    # critic.optim's default lr (1e-5) differs from OptimConfig's (1e-6): setting only
    # betas keeps the critic's own default (an enabled critic: a disabled one refuses it).
    cfg = run_from_dict(tiny(algorithm={"adv_estimator": "gae"},
                             critic={"enabled": True, "optim": {"betas": [0.9, 0.95]}}))
    assert cfg.critic.optim.lr == 1e-5 and cfg.critic.optim.betas == (0.9, 0.95)
    assert cfg.actor.optim.lr == 1e-6


def test_sibling_keys_in_messages_are_fully_qualified(tiny):
    with pytest.raises(ConfigError, match=r"^actor\.optim\.min_lr: must be <= actor\.optim\.lr \(0\.001\), got 0\.1"):
        run_from_dict(tiny(actor={"optim": {"lr": 1e-3, "min_lr": 0.1}}))


@pytest.mark.parametrize("sections, key, fragment", [
    ({"algorithm": {"adv_estimator": "gae"}}, "critic.enabled", "'gae' needs a critic"),
    ({"critic": {"enabled": True}}, "critic.enabled", "only used by adv_estimator 'gae'"),
    ({"algorithm": {"use_kl_loss": True}}, "ref.enabled", "use_kl_loss=true needs reference log-probs"),
    ({"algorithm": {"use_kl_in_reward": True}}, "ref.enabled", "use_kl_in_reward=true"),
    ({"rollout": {"n": 1}}, "rollout.n", "needs n >= 2"),
    ({"actor": {"clip_ratio_c": 0.5}}, "actor.clip_ratio_c", "dual-clip bound must be > 1"),
    ({"actor": {"vpp": 2}}, "actor.vpp", "needs actor.pp >= 2"),
    ({"rollout": {"top_p": 0.0}}, "rollout.top_p", "must lie in (0, 1]"),
    ({"reward": {"format_weight": 1.5}}, "reward.format_weight", "must lie in [0, 1]"),
    ({"reward": {"functions": {"mine": "not_a_target"}}}, "reward.functions.mine", "package.module:function"),
    ({"trainer": {"experiment_name": "a/b"}}, "trainer.experiment_name", "without '/'"),
    ({"trainer": {"logger": ["console", "console"]}}, "trainer.logger", "duplicate"),
    ({"trainer": {"logger": ["console", "mlflow"]}}, "trainer.logger[1]", "invalid value 'mlflow'"),
    ({"data": {"train_files": ["a.parquet"]}}, "data.task", "set either data.train_files or data.task"),
    ({"actor": {"sequence_parallel": True, "tp": 2}}, "actor.sequence_parallel",
     "not available on CPU (megatron-core's local layer spec refuses it); set it false or resources.use_gpu=true"),
])
def test_invalid_values_name_their_key(tiny, sections, key, fragment):
    with pytest.raises(ConfigError) as err:
        run_from_dict(tiny(**sections))
    assert err.value.key == key
    assert fragment in str(err.value)


def test_choices_match_the_algorithms_module():
    import megaflow.algorithms as algos

    assert set(schema.ADV_ESTIMATORS) == set(algos.ADVANTAGE_ESTIMATORS)
    assert set(schema.KL_LOSS_TYPES) == set(algos.KL_KINDS)
    assert set(schema.LOSS_AGG_MODES) == set(algos.LOSS_AGG_MODES)
    assert set(schema.POLICY_LOSSES) == set(algos.POLICY_LOSSES)
    assert set(schema.KL_ESTIMATORS) | {k + "+" for k in schema.KL_ESTIMATORS if k not in ("k2", "mse")} \
        == set(algos.KL_KINDS)


def test_config_errors_survive_pickling():
    import pickle

    err = ConfigError("actor.optim.min_lr", "must be <= {0}", ("actor.optim.lr",))
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) == "actor.optim.min_lr: must be <= actor.optim.lr" and again.key == err.key


def test_use_gpu_null_means_detect(tiny, monkeypatch):
    import shutil

    tree = tiny(resources={"use_gpu": None})
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    assert run_from_dict(tree).resources.use_gpu is True
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert run_from_dict(tree).resources.use_gpu is False


def test_names_read_as_numbers_become_strings(tiny):
    cfg = run_from_dict(tiny(trainer={"experiment_name": 2024}, data={"task": None, "train_files": "a.parquet"}))
    assert cfg.trainer.experiment_name == "2024" and cfg.data.train_files == ("a.parquet",)
