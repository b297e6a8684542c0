"""Safe RLHF's stages in the controller's step with fake worker groups: the cost, the cost
critic's values and update, lambda's dual ascent and the combined advantage by hand, and
lambda resumed exactly from a checkpoint."""
from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch

from megaflow.algorithms import compute_advantages
from megaflow.config.schema import SafeRLHFConfig
from megaflow.protocol import DataProto
from megaflow.trainer.checkpoint import CheckpointManager
from megaflow.trainer.ppo_trainer import RayPPOTrainer, WorkerGroups
from megaflow.trainer.proxies import ActorProxy, CostCriticProxy, CriticProxy
from megaflow.trainer.safe_rlhf import SafeRLHF
from tests.trainer.test_ppo_trainer_fake import FakeActor, Loader, LocalGroup, make_cfg, reward_fn

SAFE = SafeRLHFConfig(enable=True, cost_function="contains_digit", cost_kwargs={"digit": 8}, cost_limit=0.3,
                      lambda_init=0.5, lambda_lr=0.7, lambda_max=None)


class FakeCritic:
    """Values = scale x (response token id); records its updates; a version file as checkpoint."""

    def __init__(self, scale: float) -> None:
        self.scale, self.updates, self.version = scale, [], 0

    def compute_values(self, batch: DataProto) -> DataProto:
        return DataProto.from_dict({"values": batch.batch["responses"].float() * self.scale})

    def update_critic(self, batch: DataProto) -> list[dict[str, float]]:
        self.updates.append(batch)
        self.version += 1
        return [{"critic/vf_loss": self.scale * self.version}]

    def save_checkpoint(self, path: str) -> None:
        os.makedirs(path)
        torch.save({"version": self.version}, f"{path}/state.pt")

    def load_checkpoint(self, path: str) -> None:
        self.version = torch.load(f"{path}/state.pt")["version"]


class DigitTokenizer:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(str(i) for i in ids)


def run(tmp_path, total_steps, resume="disable"):
    cfg = make_cfg(tmp_path, total_steps, resume)
    cfg.algorithm.adv_estimator, cfg.algorithm.lam, cfg.algorithm.safe_rlhf = "gae", 0.9, SAFE
    cfg.critic = SimpleNamespace(optim=SimpleNamespace(clip_grad=1.0))
    actor, critic, cost_critic = FakeActor(), FakeCritic(0.1), FakeCritic(-0.05)
    groups = WorkerGroups(actor=ActorProxy(LocalGroup(actor)), critic=CriticProxy(LocalGroup(critic)),
                          cost_critic=CostCriticProxy(LocalGroup(cost_critic)))
    trainer = RayPPOTrainer(cfg, groups, reward_fn, Loader(), checkpoints=CheckpointManager(tmp_path / "ckpt"),
                            safe_rlhf=SafeRLHF(cfg, DigitTokenizer()))
    return trainer, actor, critic, cost_critic


@pytest.fixture
def logged(monkeypatch):
    """Every step's metrics, in order."""
    seen = []
    monkeypatch.setattr(RayPPOTrainer, "_log", lambda self, metrics, step: seen.append(dict(metrics)))
    return seen


def test_one_step_by_hand(tmp_path, logged):
    trainer, actor, critic, cost_critic = run(tmp_path, total_steps=1)
    trainer.fit()
    batch = actor.updates[0]
    sent = cost_critic.updates[0].batch
    mask = sent["response_mask"]
    responses = sent["responses"]
    # the rule cost: 1 on the last valid token of every response with an 8 among its valid tokens
    has8 = torch.tensor([8 in r[m.bool()].tolist() for r, m in zip(responses, mask, strict=True)], dtype=torch.float32)
    costs = torch.zeros(mask.shape)
    costs[torch.arange(len(has8)), mask.sum(-1) - 1] = has8
    cost_adv, cost_ret = compute_advantages("gae", token_level_rewards=costs, response_mask=mask,
                                            values=responses.float() * -0.05, gamma=1.0, lam=0.9)
    # the cost critic regresses its own values towards the cost's GAE returns
    assert torch.allclose(sent["values"], responses.float() * -0.05)
    assert torch.allclose(sent["returns"], cost_ret)
    # the reward critic keeps the reward's returns
    assert not torch.allclose(critic.updates[0].batch["returns"], cost_ret)
    # lambda: log 0.5 + 0.7 x 0.5 x (mean cost - 0.3)
    lam = math.exp(math.log(0.5) + 0.7 * 0.5 * (float(has8.mean()) - 0.3))
    metrics = logged[-1]
    assert metrics["safe/lambda"] == pytest.approx(lam)
    assert metrics["safe/episode_cost/mean"] == pytest.approx(float(has8.mean()))
    assert metrics["cost_critic/vf_loss"] == pytest.approx(-0.05)
    assert metrics["critic/vf_loss"] == pytest.approx(0.1)
    reward_adv = compute_advantages("gae", token_level_rewards=_rewards(trainer, responses, mask),
                                    response_mask=mask, values=responses.float() * 0.1, gamma=1.0, lam=0.9)[0]
    expected = (reward_adv - lam * cost_adv) / (1 + lam)
    assert torch.allclose(batch.batch["advantages"], expected, atol=1e-6)


def _rewards(trainer, responses, mask):
    return reward_fn(DataProto.from_dict({"responses": responses, "response_mask": mask})).batch["token_level_scores"]


def test_lambda_and_the_cost_critic_resume_exactly(tmp_path, logged):
    full, *_ = run(tmp_path / "a", total_steps=4)
    full.fit()
    lambdas = [m["safe/lambda"] for m in logged]
    part, *_ = run(tmp_path / "b", total_steps=2)
    part.fit()
    assert {"cost_critic", "critic"} <= set(os.listdir(tmp_path / "b" / "ckpt" / "global_step_2"))
    logged.clear()
    resumed, _, _, cost_critic = run(tmp_path / "b", total_steps=4, resume="auto")
    resumed.fit()
    assert cost_critic.version == 4
    assert [m["safe/lambda"] for m in logged] == lambdas[2:]  # bit-identical
    assert len(set(lambdas)) == 4
