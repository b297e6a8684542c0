"""Keys that nothing reads are refused at load (megaflow.topology.validate._check_inert_keys):
a key under a feature that is off, set to anything but its schema default, is refused through
the real command line (``make train ...``, then the trainer's ``main`` and its dry run), as a
row of README's "Bad input" table is; a recipe that restates a default still loads."""
from __future__ import annotations

import pytest

import tests.test_bad_input_table as table
from megaflow.config.schema import AgentConfig, Config
from megaflow.topology import load_run
from tests.test_bad_input_table import model_dir  # noqa: F401  (the fixture the row runner takes)

ROWS = [
    ("make train critic.optim.lr=1e-3", "critic.optim.lr: set to 0.001, but critic.enabled=false turns this off"),
    ("make train actor.lora.sync=adapter", "actor.lora.sync: set to 'adapter', but actor.lora.rank=0 turns this off"),
    ("make train actor.lora.alpha=64", "actor.lora.alpha: set to 64.0, but actor.lora.rank=0 turns this off"),
    ("make train rollout.agent.max_turns=2",
     "rollout.agent.max_turns: set to 2, but rollout.agent.enabled=false turns this off"),
    ("make train algorithm.safe_rlhf.lambda_lr=0.5",
     "algorithm.safe_rlhf.lambda_lr: set to 0.5, but algorithm.safe_rlhf.enable=false turns this off"),
    ("make train algorithm.filter_groups.metric=acc",
     "algorithm.filter_groups.metric: set to 'acc', but algorithm.filter_groups.enable=false turns this off"),
    ("make train trainer.max_staleness=3",
     "trainer.max_staleness: set to 3, but trainer.async_rollout=false turns this off"),
    ("make train trainer.test_freq=0 trainer.val_max_samples=4",
     "trainer.val_max_samples: set to 4, but trainer.test_freq=0 and trainer.val_before_train=false turn validation off"),
    ("make train algorithm.safe_rlhf.enable=true",
     "algorithm.safe_rlhf.enable: needs algorithm.adv_estimator=gae"),
    ("make train RECIPE=tiny_arith_safe_ppo algorithm.safe_rlhf.lambda_max=0.5",
     "algorithm.safe_rlhf.lambda_init: 1.0 exceeds algorithm.safe_rlhf.lambda_max=0.5"),
]


@pytest.mark.parametrize("command, expected", ROWS, ids=[r[0] for r in ROWS])
def test_refused_through_the_command_line(command, expected, tmp_path, model_dir, capsys, monkeypatch):  # noqa: F811
    table.test_bad_input_row(command, "", expected, tmp_path, model_dir, capsys, monkeypatch)


def test_a_restated_default_loads():
    """The rule compares against the schema defaults: the values a feature that is off would
    take anyway are accepted, so a recipe may spell them out."""
    defaults = Config()
    cfg = load_run("tiny_arith_grpo", [f"critic.optim.lr={defaults.critic.optim.lr}",
                                       f"rollout.agent.max_turns={AgentConfig().max_turns}",
                                       f"actor.lora.alpha={defaults.actor.lora.alpha}",
                                       "actor.lora.sync=merged", "trainer.max_staleness=1"])
    assert not cfg.critic.enabled and cfg.critic.optim.lr == defaults.critic.optim.lr


def test_a_switch_turned_off_on_the_command_line_leaves_the_recipes_settings_alone():
    """Only what the command line sets is checked: turning a recipe's feature off by its switch
    keeps the recipe's own (now unread) settings loadable, as does a checkpoint's config."""
    cfg = load_run("tiny_arith_grpo_lora", ["actor.lora.rank=0", "algorithm.use_kl_loss=false"])
    assert cfg.actor.lora.rank == 0 and cfg.actor.lora.alpha != Config().actor.lora.alpha
    cfg = load_run("smollm2_gsm8k_grpo", ["trainer.test_freq=0", "trainer.val_before_train=false"])
    assert cfg.trainer.val_max_samples == 32
    with pytest.raises(ValueError, match="actor.lora.alpha: set to 8.0, but actor.lora.rank=0 turns this off"):
        load_run("tiny_arith_grpo_lora", ["actor.lora.rank=0", "algorithm.use_kl_loss=false", "actor.lora.alpha=8"])
