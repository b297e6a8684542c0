"""The controller's step with ``actor.on_policy_old_log_probs``: no old-log-prob call, and the
update is sent no ``old_log_probs`` (the fake worker groups of ``test_ppo_trainer_fake``)."""
from types import SimpleNamespace

import torch

from megaflow.trainer.checkpoint import CheckpointManager
from megaflow.trainer.ppo_trainer import RayPPOTrainer
from test_ppo_trainer_fake import FakeActor, Loader, actor_groups, make_cfg, reward_fn


def _step(tmp_path, on_policy):
    cfg = make_cfg(tmp_path, total_steps=1)
    cfg.actor = SimpleNamespace(**{**vars(cfg.actor), "on_policy_old_log_probs": on_policy})
    actor = FakeActor()
    trainer = RayPPOTrainer(cfg, actor_groups(actor), reward_fn, Loader(),
                            checkpoints=CheckpointManager(tmp_path / "ckpt"))
    trainer.fit()
    return actor


def test_on_policy_step_skips_the_old_log_prob_call(tmp_path):
    """With ``actor.on_policy_old_log_probs`` the step goes from the rollout to the update."""
    on, off = _step(tmp_path / "on", True), _step(tmp_path / "off", False)
    assert [c[0] for c in off.calls] == ["generate", "log_prob", "update"]
    assert [c[0] for c in on.calls] == ["generate", "update"]
    assert on.calls[1][2] == ["advantages", "attention_mask", "input_ids", "response_mask", "responses",
                              "rollout_log_probs"]
    # the same rollout and advantages reach the update either way (the fake's old log-probs equal the rollout's)
    for key in ("advantages", "responses", "response_mask"):
        assert torch.equal(on.updates[0].batch[key], off.updates[0].batch[key])
