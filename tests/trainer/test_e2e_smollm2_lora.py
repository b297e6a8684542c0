"""The SmolLM2 LoRA recipe ``smollm2_gsm8k_grpo_lora_cpu``: SmolLM2-135M-Instruct on GSM8K
trained through rank-16 adapters (the LoRA twin of ``smollm2_gsm8k_grpo_cpu``, whose fixtures
this file reuses).

The recipe is checked at load against its full-fine-tuning twin (same model, data, rollout,
reward; adapters on, no KL); a slow test runs two of its steps cut to the suite's budget and
checks what a LoRA run must show: only the adapters in the optimizer (and the checkpoint), the
base bit-unchanged after two updates (its export against the prepared HF weights) while the
adapters moved, generations written and a validation score logged.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_e2e_smollm2 import CPU_RECIPE, gsm8k_dir, smollm2_dir  # noqa: F401 (fixtures)

from megaflow.topology import load_run
from megaflow.trainer.main import run_dir_of, train
from megaflow.utils.tracking import read_metrics_jsonl

LORA_RECIPE = "smollm2_gsm8k_grpo_lora_cpu"
USAGE = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
#: the Megatron linears of one layer (megaflow.config.schema.LORA_TARGETS) and the HF names PEFT
#: gives them (megaflow.models.peft_io: fused QKV and gate/up split into their HF projections).
TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_lora_recipe_is_the_cpu_recipe_with_adapters():
    """The LoRA recipe differs from the full-fine-tuning CPU recipe only in the actor's
    adapters and optimizer: the model, data, rollout, reward, validation and threads are the
    same, so its step time and curve compare with the full recipe's; docs/usage.md trains it."""
    lora, full = load_run(LORA_RECIPE), load_run(CPU_RECIPE)
    for section in ("model", "data", "rollout", "reward", "resources", "algorithm", "ref"):
        assert getattr(lora, section) == getattr(full, section), section
    assert lora.trainer.total_steps == full.trainer.total_steps and lora.trainer.test_freq == full.trainer.test_freq
    assert (lora.actor.lora.rank, lora.actor.lora.alpha, lora.actor.lora.target_modules) == (16, 32.0, TARGETS)
    assert full.actor.lora.rank == 0 and not lora.ref.enabled and not lora.algorithm.use_kl_loss
    assert lora.actor.optim.lr == 10 * full.actor.optim.lr
    assert f"make train RECIPE={LORA_RECIPE}" in USAGE.read_text()


def _safetensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_lora_cpu_trains_only_the_adapters(ray_session, tmp_path, smollm2_dir, gsm8k_dir):  # noqa: F811
    """Two steps of the LoRA recipe (2 prompts x 2 samples of at most 32 tokens), validation on
    2 prompts after the last step, an adapter-only checkpoint and an HF export at step 2.
    ``actor.entropy_coeff`` makes the loss's gradient non-zero whatever the (at this length
    usually all-zero) rewards, so the adapters always move and step 2 generates with trained ones."""
    from megatron.core import dist_checkpointing

    response_length = 32
    cfg = load_run(LORA_RECIPE, [
        f"model.path={smollm2_dir}",
        f"data.train_files=[{gsm8k_dir / 'train.parquet'}]", f"data.val_files=[{gsm8k_dir / 'test.parquet'}]",
        "trainer.total_steps=2", "trainer.val_before_train=false", "trainer.val_max_samples=2",
        "trainer.logger=[jsonl]", "trainer.save_freq=2", "trainer.export_hf=true",
        "data.train_batch_size=2", "rollout.n=2", f"rollout.response_length={response_length}",
        "actor.ppo_mini_batch_size=2", "actor.entropy_coeff=0.01", f"trainer.output_dir={tmp_path}"])
    train(cfg)
    run_dir = run_dir_of(cfg)
    rows = read_metrics_jsonl(run_dir / "metrics.jsonl")
    steps = {int(r["step"]): r for r in rows if "critic/score/mean" in r}
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert m["actor/update_successful"] == 1.0 and m["actor/grad_norm"] > 0.0
    # step 2 generated with the merged weights W + (alpha / rank) B A of step 1's adapters
    assert steps[2]["training/rollout_probs_diff_max"] < 1e-3
    (v,) = [r for r in rows if "val/score/mean" in r]
    assert int(v["step"]) == 2 and 0.0 <= v["val/score/mean"] <= 1.0
    records = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert {(r["step"], r["split"]) for r in records} == {(2, "train"), (2, "val")}
    assert all(r["prompt"] and 1 <= r["response_tokens"] <= response_length for r in records)

    # only the adapters train: the checkpoint's model part is the adapters (rank 16, every layer,
    # stacked over the 30 layers) and the optimizer's only state is Adam's moments of those
    layers, rank = cfg.model.hf_config["num_hidden_layers"], cfg.actor.lora.rank
    ckpt = run_dir / "checkpoints" / "global_step_2" / "actor"
    adapters = dist_checkpointing.load_tensors_metadata(str(ckpt / "adapter"))
    paths = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    assert sorted(adapters) == sorted(f"decoder.layers.{p}.lora_{x}.weight" for p in paths for x in "ab")
    for name, meta in adapters.items():
        shape = tuple(meta.global_shape)
        assert shape[0] == layers and (shape[1] if ".lora_a." in name else shape[2]) == rank, (name, shape)
    optimizer = dist_checkpointing.load_tensors_metadata(str(ckpt / "optimizer"))
    assert sorted(optimizer) == sorted(f"optimizer.state.{s}.{k}" for s in ("exp_avg", "exp_avg_sq") for k in adapters)

    # the base is bit-unchanged after two updates; the adapters moved (B started at zero)
    base, exported = _safetensors(smollm2_dir), _safetensors(run_dir / "hf")
    assert sorted(exported) == sorted(base)
    changed = [name for name, tensor in base.items() if not exported[name].equal(tensor)]
    assert not changed, changed[:5]
    lora_b = {k: t for k, t in _safetensors(run_dir / "hf" / "adapter").items() if ".lora_B." in k}
    assert len(lora_b) == layers * len(PEFT_TARGETS)
    assert all(t.abs().max() > 0 for t in lora_b.values())
